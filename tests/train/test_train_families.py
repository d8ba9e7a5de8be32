"""Training: the loss falls for every family (40 steps of the tiny model)."""

import numpy as np
import pytest
from conftest import losses, small_config

from posattn import families
from posattn.train import train_and_evaluate


@pytest.mark.parametrize("position", families.names())
def test_loss_falls_for_every_family(tmp_path, position):
    config = small_config(
        model__position=position,
        train__steps=40,
        train__learning_rate=3e-3,
        train__checkpoint_every=40,
    )
    result = train_and_evaluate(config, tmp_path)
    values = losses(tmp_path)
    assert len(values) == 40 and result["finished"]
    assert np.mean(values[-5:]) < np.mean(values[:5]) - 0.5, values
    assert values[0] == pytest.approx(np.log(256), abs=0.5)  # starts near uniform over bytes
