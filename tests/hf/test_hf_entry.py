"""Entry points with Hugging Face checkpoints: `python -m posattn.generate --hf`, fine-tuning from
`model.init_from='hf:PATH'`, and uint32 token files (vocabularies past 65536)."""

import pathlib
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import posattn.hf as hf
from posattn import config as config_lib
from posattn import generate
from posattn.nn.config import ConfigError

GOLDENS = pathlib.Path(__file__).parent / "goldens"


def _with_tokenizer(tmp_path, case="llama_gqa"):
    import tokenizers
    from tokenizers import models, pre_tokenizers

    path = tmp_path / case
    shutil.copytree(GOLDENS / case, path)
    vocab = {f"w{i}": i for i in range(64)}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    return path


def _greedy_by_full_forward(model, prompt, n):
    ids = list(prompt)
    forward = nnx.jit(lambda m, t: m(t))
    for _ in range(n):
        logits = forward(model, jnp.asarray([ids]))
        ids.append(int(jnp.argmax(logits[0, -1])))
    return ids[len(prompt) :]


# The windowed cases have windows of 6, so 5 + 10 tokens wrap their ring-buffer caches.
@pytest.mark.parametrize(
    "case, n",
    [
        ("llama_gqa", 4),
        ("qwen2_layer_types", 10),
        ("qwen3_window", 10),
        ("phi3_partial", 10),
        ("smollm3_window", 10),
        ("ministral", 10),
        ("starcoder2", 10),
        ("gemma2_legacy", 10),
        ("gemma3_legacy", 10),
    ],
)
def test_generate_hf_greedy_equals_the_full_forward_and_transformers(tmp_path, capsys, case, n):
    path = _with_tokenizer(tmp_path, case)
    prompt = "w3 w17 w42 w5 w9"
    assert generate.main(["--hf", str(path), "--prompt", prompt, "--max_new_tokens", str(n)]) == 0
    out = capsys.readouterr()
    new = [int(t) for t in out.err.split("tokens ")[1].split("\n")[0].split()]
    assert out.out.startswith(prompt)
    prompt_ids = [3, 17, 42, 5, 9]
    assert new == _greedy_by_full_forward(hf.from_pretrained(path), prompt_ids, n)
    pytest.importorskip("transformers")
    import torch
    import transformers

    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        ids = ref.generate(
            torch.as_tensor([prompt_ids]), max_new_tokens=n, do_sample=False, pad_token_id=0
        )
    assert ids[0, 5:].tolist() == new


def test_generate_hf_without_a_tokenizer_names_the_file(tmp_path, capsys):
    path = tmp_path / "m"
    shutil.copytree(GOLDENS / "llama_gqa", path)
    assert generate.main(["--hf", str(path), "--prompt", "x"]) == 2
    assert "tokenizer.json" in capsys.readouterr().err


def _token_dir(tmp_path):
    data = tmp_path / "tokens"
    data.mkdir()
    rng = np.random.default_rng(0)
    rng.integers(0, 64, 4000).astype(np.uint32).tofile(data / "train.u32.bin")
    rng.integers(0, 64, 1000).astype(np.uint32).tofile(data / "val.u32.bin")
    return data


def _finetune_config(data, case="llama_gqa", **model):
    config = config_lib.defaults()
    config.data.corpus = str(data)
    config.data.seq_len = 16
    config.train.update(
        steps=1, batch_size=2, checkpoint_every=1, eval_every=0, learning_rate=1e-9, warmup_steps=0
    )
    config.model.update(init_from=f"hf:{GOLDENS / case}", **model)
    return config


# gemma3: position interpolation reaches its global layers; its local layers keep their own RoPE
# (smollm3_window: its RoPE layers; the NoPE layer has none to scale). gemma2: one RoPE on every
# layer, local or global, so every layer's (and the soft caps train through).
@pytest.mark.parametrize("case", ["llama_gqa", "qwen3", "smollm3_window", "gemma2", "gemma3"])
def test_finetuning_starts_from_the_checkpoint_with_position_interpolation(tmp_path, case):
    from posattn.train import restore_trained, train_and_evaluate

    data = _token_dir(tmp_path)
    pi = {"rope_type": "linear", "factor": 2.0}
    config = _finetune_config(data, case, rope_scaling=pi)
    cfg = config_lib.validate(config)
    assert cfg.d_model == 32 and cfg.mlp == "gated" and cfg.settings.scaling_dict["factor"] == 2.0
    rope = [s for s in cfg.layers if s.position == "rope"]  # smollm3's NoPE layer has none
    global_layers = [s for s in rope if s.window is None]
    assert all(s.settings.scaling_dict == cfg.settings.scaling_dict for s in global_layers)
    local = [s.settings.scaling_dict for s in rope if s.window is not None]
    assert local == ([cfg.settings.scaling_dict] if case == "gemma2" else [None] * len(local))
    from posattn import data as data_lib

    corpus = data_lib.load_corpus(str(data))
    assert corpus.train.dtype == np.uint32 and corpus.vocab_size <= 64
    train_and_evaluate(config, tmp_path / "run")
    _, state, step = restore_trained(config, tmp_path / "run" / "checkpoints")
    assert step == 1
    loaded = hf.load_params(GOLDENS / case, cfg)
    import jax

    for a, b in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(loaded), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_finetuning_refuses_an_architecture_key_that_disagrees(tmp_path):
    config = _finetune_config(tmp_path, d_model=64)
    with pytest.raises(ConfigError, match=r"config\.model\.d_model=64 disagrees"):
        config_lib.validate(config)


def test_loading_under_a_mesh_places_each_tensor_on_its_fsdp_sharding():
    from conftest import run_python

    out = run_python(
        """
        import numpy as np, jax, jax.numpy as jnp
        import posattn.hf as hf
        from posattn.train import sharding
        mesh = sharding.make_mesh(2)
        path = "tests/hf/goldens/neox_parallel"
        model = hf.from_pretrained(path, mesh=mesh)
        wq = model.blocks[0].attn.wq[...]
        from flax import nnx
        ref = nnx.state(hf.from_pretrained(path))  # the same values on one device
        pairs = zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(ref), strict=True)
        err = max(float(np.abs(np.asarray(x) - np.asarray(y)).max()) for x, y in pairs)
        print(wq.sharding.spec, len(wq.addressable_shards), err)
        """,
        devices=2,
    )
    spec, shards, err = out.strip().rsplit(" ", 2)
    assert "fsdp" in spec and int(shards) == 2 and float(err) == 0.0


def test_a_sweep_member_starts_from_the_checkpoint_as_its_single_run(tmp_path):
    import types

    import jax

    from posattn.sweep import run as sweep_run

    config = _finetune_config(tmp_path)
    cfg = config_lib.validate(config)
    member = types.SimpleNamespace(cfg=cfg, config=config, index=0, overrides={})
    (state,) = sweep_run._initial_members(types.SimpleNamespace(members=[member]))
    loaded = hf.load_params(GOLDENS / "llama_gqa", cfg)
    for a, b in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(loaded), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
