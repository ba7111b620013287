"""The job: its config composed from a command line, and every check of it before anything runs.

    command_line.py  what Hydra would refuse, refused in one line; the config composed as the launcher does
    schema.py        the config's schema is its defaults: each option's kind, misspelled keys
    checks.py        the core's checks of a composed job (numbers, batch split, schedule, data, memory)
    model_folder.py  a job starting from a Hugging Face folder: its options, tokenizer, and what is refused
    run_dir.py       where a run writes
    searchpath.py    the installed plugins' config options on Hydra's search path

The launcher (``titan_core.launch``) and the planner (``titan_core.planner``) both start here.
"""
