"""Every config shipped in smf/configs/ loads without a warning: the project's own files use the current spellings
(a DeprecationWarning about them would be the first thing a newcomer reads)."""
import logging
import warnings

import pytest

from smf.suite.config import load_suite_config
from smf.options import read_file
from smf.train.config import CONFIGS, OPTIONS, read_config_file

SHIPPED = sorted(path.name for path in CONFIGS.glob("*.yaml"))


def test_every_shipped_config_is_checked():
    assert {"paper.yaml", "tiny.yaml", "preset_tiny.yaml", "suite_paper.yaml", "suite_tiny.yaml"} <= set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_a_shipped_config_loads_without_a_warning(name, caplog):
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING):
        warnings.simplefilter("error")
        if name.startswith("suite_"):
            load_suite_config(name.removeprefix("suite_").removesuffix(".yaml"))
        elif name == "preset_tiny.yaml":  # read as smf.train.config reads it (its paths: against its folder)
            read_file(CONFIGS / name, OPTIONS)
        else:
            for command in ("retrofit", "background", "train"):
                read_config_file(CONFIGS / name, command)
    assert [record.getMessage() for record in caplog.records] == []
