"""The launcher: from a command line to a checked plan, then to the workers that train it.

    command_line.py  what Hydra would refuse, refused in one line before it composes anything
    checks.py        the core's checks of a composed job, and the plan they yield (``prepare``)
    main.py          ``python -m titan_core.run``: Hydra's entry, the run dir, starting the workers
    worker.py        one rank: device, log, process group, the training loop, one line for how it ended
    run_dir.py       where a run writes
    cluster.py       the nodes of a job: this machine, or a SLURM allocation
    provenance.py    ``run.json``: what a run was
    searchpath.py    the installed plugins' config options on Hydra's search path
"""
