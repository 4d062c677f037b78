"""``python -m dualpipe_megatron.launch_plan``: the launch plan's first command name, kept so that
commands written for it still run; the plan is :mod:`dualpipe_megatron.plan`."""

from .plan.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
