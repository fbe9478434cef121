"""amprewrite.trainers.torchtitan: torchtitan's own launcher with amprewrite's plan (issue 53
item 6). Without torchtitan (the default test environment) install() says how to get it; with
torchtitan 0.3 (its own venv: benchmarks/torchtitan_recipe.py's docstring) install() is
idempotent, refuses another release, and the config module hands torchtitan's configs over
with the amprewrite backend."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from amprewrite.errors import PolicyError

HAVE_TORCHTITAN = importlib.util.find_spec("torchtitan") is not None


@pytest.mark.skipif(HAVE_TORCHTITAN, reason="torchtitan is installed here")
def test_without_torchtitan_install_says_how_to_get_it():
    from amprewrite.trainers import torchtitan as tt

    with pytest.raises(PolicyError, match=r"pip install 'torchtitan==0\.3\.\*'"):
        tt.install()
    with pytest.raises(AttributeError, match="torchtitan is not installed"):
        tt.llama3_debugmodel  # noqa: B018  (the launcher's getattr of a config name)


@pytest.mark.skipif(not HAVE_TORCHTITAN, reason="needs torchtitan 0.3 (its own venv)")
def test_install_is_idempotent_and_refuses_other_releases(monkeypatch):
    import torchtitan.distributed.compile as tt_compile
    import torchtitan.distributed.fsdp as tt_fsdp

    from amprewrite.trainers import torchtitan as tt

    tt.install(cpu=False)
    shard, scoop = tt_fsdp.fully_shard, tt_compile._maybe_regional_inductor_backend
    tt.install(cpu=False)
    assert (tt_fsdp.fully_shard, tt_compile._maybe_regional_inductor_backend) == (shard, scoop)
    assert shard.__wrapped__.__module__ == "amprewrite.compile.sharding"
    assert scoop(None, "amprewrite-eager") == "amprewrite-eager"
    monkeypatch.setattr(tt, "_version", lambda: (0, 9))
    with pytest.raises(PolicyError, match=r"supports torchtitan 0\.3, found 0\.9"):
        tt.install()


@pytest.mark.skipif(not HAVE_TORCHTITAN, reason="needs torchtitan 0.3 (its own venv)")
def test_the_config_module_hands_torchtitans_configs_over_with_the_backend():
    from amprewrite.trainers import torchtitan as tt

    config = tt.llama3_debugmodel()
    assert config.compile.backend == "amprewrite"
    assert config.training.mixed_precision_param == "bfloat16"
    # the command line offers no float16: NAME_float16 is NAME with it
    assert tt.llama3_debugmodel_float16().training.mixed_precision_param == "float16"
    with pytest.raises(AttributeError, match="no torchtitan config function"):
        tt.no_such_config  # noqa: B018


LAUNCH = ["-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "torchtitan.train",
          "--module", "amprewrite.trainers.torchtitan", "--compile.enable",
          "--compile.backend", "amprewrite-eager", "--training.steps", "3",
          "--training.seq_len", "64", "--training.local_batch_size", "2",
          "--parallelism.spmd_backend", "partial_dtensor", "--debug.seed", "0"]


@pytest.mark.skipif(not HAVE_TORCHTITAN or not os.environ.get("TORCHTITAN_ASSETS"),
                    reason="needs torchtitan 0.3 and TORCHTITAN_ASSETS: a folder holding "
                    "torchtitan's tests/assets (c4_test, tokenizer)")
@pytest.mark.parametrize("config", ["llama3_debugmodel", "llama3_debugmodel_float16"])
def test_torchtitans_launcher_trains_with_the_plan(config):
    """``torchrun -m torchtitan.train --module amprewrite.trainers.torchtitan`` on 2 gloo
    processes, bf16 and fp16: it trains (finite, falling losses)."""
    done = subprocess.run([sys.executable, *LAUNCH, "--config", config],
                          cwd=Path(os.environ["TORCHTITAN_ASSETS"]),
                          env={**os.environ, "AMPREWRITE_TORCHTITAN_CPU": "1"},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    text = re.sub(r"\x1b\[[0-9;]*m", "", done.stdout + done.stderr)  # torchtitan's colours
    losses = [float(m.group(1)) for m in re.finditer(r"step:\s+\d+\s+loss:\s+([\d.]+)", text)]
    assert len(losses) >= 3 and losses[-1] < losses[0], losses
