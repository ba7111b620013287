"""Every ``fix:`` the core and the plugins print is a command line that works as written: a sample of refusals
whose fix is a setting, each applied exactly as printed (``set a.b=c``: the override ``a.b=c``), after which the
same job passes the launcher's checks or is refused further on, for another field. A fix naming an option by its
bare name (``set recipe=tensorwise``) or one Hydra refuses as written fails here."""

import re

import pytest

from titan_core.errors import ConfigError
from titan_core.job.command_line import check_command_line
from titan_core.launch.cluster import job_nodes
from titan_core.launch.prepare import prepare
from titan_core.testing import TINY, compose, config_error, merged

SETTING = re.compile(r"\bset (\+?[A-Za-z_][\w.]*=[^\s,;)]+)")

REFUSED = {
    "ac-matmuls": ("+plugins=[ac]", "plugins.ac.mode=full", "plugins.ac.matmuls=every_other"),
    "async-writer": ("+plugins=[checkpoint]", "plugins.checkpoint.async_writer=process"),
    "lora-bf16-base": ("+plugins=[lora]", "plugins.lora.base_dtype=bfloat16"),
    "lora-dropout-tp": ("+plugins=[lora,tp]", "plugins.tp.degree=2", "plugins.lora.dropout=0.1"),
    "float8-gather": ("+plugins=[fsdp,float8]", "plugins.fsdp.degree=2", "plugins.float8.recipe=rowwise",
                      "plugins.float8.fsdp_float8_all_gather=true"),
    "fsdp-last-micro-batch-pp": ("+plugins=[fsdp,pp]", "plugins.fsdp.degree=2", "plugins.pp.degree=2",
                                 "plugins.fsdp.reduce_gradients=last_micro_batch"),
    "pp-v-one-stage": ("+plugins=[pp]", "plugins.pp.schedule=ZBVZeroBubble",
                       "plugins.pp.stages_per_rank=1"),
    "pp-placement": ("+plugins=[pp]", "plugins.pp.schedule=ZBVZeroBubble", "plugins.pp.placement=loop"),
}


def checked(overrides: list[str]) -> ConfigError | None:
    """The launcher's refusal of ``overrides``, or None when every check before launch passes."""
    try:
        check_command_line(overrides)
        prepare(compose(*overrides), job_nodes())
    except ConfigError as error:
        return error
    return None


@pytest.mark.parametrize("extra", REFUSED.values(), ids=REFUSED.keys())
def test_a_refusals_fix_applied_as_printed_gets_the_job_further(extra):
    job = merged(TINY, list(extra))
    refused = config_error(*job)
    fix = str(refused).split("; fix: ", 1)[1]
    setting = SETTING.search(fix)
    assert setting, f"{refused.field}: its fix names no setting to apply: {fix}"
    applied = merged(job, [setting.group(1)])
    check_command_line(applied)  # an override Hydra takes as written: a bare option name is refused here
    after = checked(applied)
    key = setting.group(1).partition("=")[0].lstrip("+")
    # Refused further on means for another field: neither the first refusal again nor the fix itself.
    assert after is None or after.field not in (refused.field, key), f"applying '{setting.group(1)}': {after}"
