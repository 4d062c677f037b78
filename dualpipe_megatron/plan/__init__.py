"""The plan of a DualPipe(V) job before any GPU is used (``python -m dualpipe_megatron.plan``).

:mod:`.job` parses and checks the job's command line and reports its plan, :mod:`.memory` counts
what each pipeline rank holds, :mod:`.compare` ranks every schedule that can run the job. The
launch templates' ``--dry-run`` and ``COMPARE=1`` run it; :mod:`dualpipe_megatron.launch` is what
runs a job.
"""
