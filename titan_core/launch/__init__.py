"""The launcher: from a checked job (``titan_core.job``) to the workers that train it.

    main.py          ``python -m titan_core.run``: Hydra's entry, the run dir, starting the workers
    prepare.py       the job's world on these nodes and devices, its plan, every check passed
    worker.py        one rank: device, log, process group, the training loop, one line for how it ended
    cluster.py       the nodes of a job: this machine, or a SLURM allocation
    provenance.py    ``run.json``: what a run was
"""
