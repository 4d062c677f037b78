"""One rank of a test training run: ``upstream_driver.py MODE SCRIPT [megatron flags...]``.

MODE ``launch``: ``python -m dualpipe_megatron.launch SCRIPT ...`` in this process (its
``launch.main``); ``script``: our ``scripts/pretrain_gpt.py`` run as ``__main__``, SCRIPT
ignored (it installs the hooks itself); ``none``: the CPU layer only, then SCRIPT. Prints one
``UPSTREAM_REPORT {json}`` line saying which megatron ran, what the guard recorded as patched
(``patch_guard.installed()``) right after ``routes.install_for_training`` ran (empty for
``none``) and after the run, and which forward_backward_func the plugin supplied.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import runpy
import sys
from typing import Any, Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRETRAIN_GPT = os.path.join(REPO, "scripts", "pretrain_gpt.py")
sys.path.insert(0, REPO)

from dualpipe_megatron.megatron.cpu_compat import install_cpu_compat  # noqa: E402
from dualpipe_megatron import launch, patch_guard, routes  # noqa: E402
from dualpipe_megatron.megatron import upstream_plugin  # noqa: E402


def _record_schedules(plugin: upstream_plugin.DualPipeSchedulePlugin, seen: list[str]) -> None:
    """Note the qualified name of every forward_backward_func the plugin hands Megatron."""
    supply = plugin.get_forward_backward_func

    def recording(*args: Any, **kwargs: Any) -> Callable | None:
        func = supply(*args, **kwargs)
        seen.append("" if func is None else f"{func.__module__}.{func.__qualname__}")
        return func

    plugin.get_forward_backward_func = recording


def main() -> None:
    mode, script, *flags = sys.argv[1:]
    routes_taken, schedules, installed_at_start = [], [], {}
    install_for_training = routes.install_for_training

    def recording_install() -> str:
        route = install_for_training()
        routes_taken.append(route)
        installed_at_start.update(patch_guard.installed())
        if route == "plugin":
            _record_schedules(upstream_plugin.PLUGIN, schedules)
        return route

    routes.install_for_training = recording_install  # what the launcher and our script call
    if mode == "launch":
        launch.main([script, *flags])
    elif mode == "script":
        sys.argv = [str(PRETRAIN_GPT), *flags]
        runpy.run_path(str(PRETRAIN_GPT), run_name="__main__")
    else:
        install_cpu_compat()
        sys.argv = [script, *flags]
        runpy.run_path(script, run_name="__main__")

    import megatron.training.training as training

    registered = None
    if upstream_plugin.has_extension_point():
        plugin = importlib.import_module(upstream_plugin.EXTENSION_POINT).get_schedule_plugin()
        registered = None if plugin is None else type(plugin).__name__
    report = {
        "route": routes_taken[0] if routes_taken else "none",
        "megatron_training": os.path.dirname(training.__file__),
        "get_model_file": inspect.getsourcefile(training.get_model),
        "installed_at_start": installed_at_start,
        "installed": patch_guard.installed(),
        "registered_plugin": registered,
        "plugin_schedules": schedules,
    }
    print("UPSTREAM_REPORT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
