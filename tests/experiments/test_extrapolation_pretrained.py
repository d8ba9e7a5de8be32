"""Rows of kind `pretrained`: a tiny committed Hugging Face checkpoint (tests/hf/goldens/llama_gqa)
with a tokenizer built here, evaluated end to end on a tiny text directory; bits per byte and BOS
checked against a direct computation from the tokenizer's offsets and transformers-equal logits;
its position-interpolation / YaRN fine-tune rows (`+linear+ft`, `+yarn+ft`) checked against the
fine-tune's own parameters and a first step computed by hand; its window row against the same
model under a window."""

import json
import pathlib
import shutil
import sys

import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from conftest import ROOT
from flax import nnx

import posattn.hf as hf
from posattn import data
from posattn.eval import lengths as lengths_lib
from posattn.nn.model import TransformerLM

sys.path.insert(0, str(ROOT / "experiments"))
import length_extrapolation as experiment  # noqa: E402

GOLDEN = ROOT / "tests" / "hf" / "goldens" / "llama_gqa"
WORDS = ["ab", "cab", "dé", "fig", "hé—", "jk", "lab", "ad", "bed", "ce"]


def _text_dir(tmp_path):
    rng = np.random.default_rng(0)
    out = tmp_path / "text"
    out.mkdir()
    for f in range(6):
        lines = [" ".join(rng.choice(WORDS, 8)) for _ in range(40)]
        (out / f"f{f}.txt").write_text("\n".join(lines), encoding="utf-8")
    return out


def _checkpoint(tmp_path, text_dir):
    """llama_gqa (vocab 64) with a BPE tokenizer of < 64 tokens that prepends <s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=48, special_tokens=["<unk>", "<s>"])
    tok.train([str(p) for p in sorted(text_dir.iterdir())], trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos)]
    )
    assert tok.get_vocab_size() <= 64
    path = tmp_path / "tiny-llama"
    shutil.copytree(GOLDEN, path)
    (path / "expected.npz").unlink()
    tok.save(str(path / "tokenizer.json"))
    return path, tok


def _args(path, workdir, *extra):
    return [
        "--config",
        str(ROOT / "configs" / "extrapolation_pretrained.py"),
        "--workdir",
        str(workdir),
        f"--config.pretrained.path={path}",
        "--config.pretrained.train_len=8",
        "--config.eval.lengths=(8,16)",
        "--config.eval.max_tokens=1000000",  # every chunk of every held-out file
        "--config.eval.sliding_tokens=64",
        "--config.eval.bootstrap=20",
        "--config.eval.batch_size=16",
        "--config.eval.attention_windows=1",
        "--config.eval.per_position_bins=4",
        "--config.rope_scalings=('yarn',)",
        *extra,
    ]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(text directory, checkpoint directory, tokenizer), shared by the tests that leave them."""
    base = tmp_path_factory.mktemp("tiny")
    text_dir = _text_dir(base)
    path, tok = _checkpoint(base, text_dir)
    return text_dir, path, tok


def _direct(path, tok, text_dir, length, *, bos, model=None):
    """(summed NLL, scored tokens, UTF-8 bytes of the scored text) of every non-overlapping
    window of `length` in every chunk of 16 tokens of each held-out file, computed from the
    file's text, the tokenizer's offsets and the model's logits (`model`, else the checkpoint's
    at `path`)."""
    corpus = data.load_corpus(str(text_dir))
    model = hf.from_pretrained(path) if model is None else model
    windows, nbytes = [], 0
    for a, b in corpus.val_spans:
        text = corpus.val[a:b].tobytes().decode()
        enc = tok.encode(text, add_special_tokens=False)
        ids = np.asarray(enc.ids)
        ends = np.maximum.accumulate([end for _, end in enc.offsets])  # chars covered by 0..i
        for c in range(0, ids.size - 16, 16):
            for k in range(16 // length):
                s = c + k * length
                window = ids[s : s + length + 1].copy()
                if bos is not None:
                    window[0] = bos
                windows.append(window)
                nbytes += len(text[ends[s] : ends[s + length]].encode("utf-8"))
    windows = np.stack(windows)
    logits = nnx.jit(lambda m, t: m(t))(model, jnp.asarray(windows[:, :-1]))
    logits = np.asarray(logits, np.float64)  # (W, T, V)
    m = logits.max(-1, keepdims=True)
    logp = logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))
    targets = windows[:, 1:]
    nll = -np.take_along_axis(logp, targets[..., None], axis=-1).sum()
    count = targets.size
    return nll, count, nbytes


@pytest.mark.figures
def test_a_checkpoint_is_evaluated_per_token_and_per_byte_with_bos(tmp_path, capsys, tiny):
    text_dir, path, tok = tiny
    work = tmp_path / "run"
    argv = _args(path, work, f"--config.data.corpus={text_dir}")
    assert experiment.main(argv) == 0, capsys.readouterr().err
    found = json.loads((work / "results.json").read_text())
    info = found["pretrained"]
    assert info["bos_token"] == "<s>" and "post-processor" in info["bos_rule"]
    assert set(info["skipped"]) == {"passkey", "induction"}  # byte-level probes
    assert found["passkey"] is None and found["induction"] is None
    assert set(found["families"]) == {"tiny-llama", "tiny-llama+yarn"}
    row = found["families"]["tiny-llama"]
    for i, length in enumerate((8, 16)):
        nll, count, nbytes = _direct(path, tok, text_dir, length, bos=tok.token_to_id("<s>"))
        assert nbytes > count  # multi-byte characters: bytes are not tokens
        assert row["eval_bytes"][i] == count and row["scored_utf8_bytes"][i] == nbytes
        np.testing.assert_allclose(row["loss"][i], nll / count, rtol=2e-5)
        np.testing.assert_allclose(row["bits_per_byte"][i], nll / (np.log(2) * nbytes), rtol=2e-5)
    # At L the scaling row reads the checkpoint itself; past L, its YaRN.
    scaled = found["families"]["tiny-llama+yarn"]
    assert scaled["loss"][0] == row["loss"][0] and scaled["loss"][1] != row["loss"][1]
    assert found["attention_stats"]["rows"]["tiny-llama"][1] is not None
    for name in ("results.md", "loss_vs_length.png", "bits_per_byte_vs_length.png"):
        assert (work / name).is_file(), name
    md = (work / "results.md").read_text()
    assert "Bits per byte" in md and "`passkey` skipped" in md and "BOS '<s>'" in md

    # Without BOS the windows start in the text: a different loss, again the direct one; the
    # window row (named by the checkpoint) reads it under a window of L = 8 past L.
    plain = tmp_path / "plain"
    argv = _args(
        path,
        plain,
        f"--config.data.corpus={text_dir}",
        "--config.pretrained.bos=never",
        "--config.rope_scalings=('self_extend',)",
        "--config.eval.attention_windows=0",
    )
    assert experiment.main([*argv, "--config.window_rows=('rope',)"]) == 2
    assert "config.window_rows=('tiny-llama',)" in capsys.readouterr().err
    assert not plain.exists()
    assert experiment.main([*argv, "--config.window_rows=('tiny-llama',)"]) == 0
    fams = json.loads((plain / "results.json").read_text())["families"]
    again = fams["tiny-llama"]
    nll, count, _ = _direct(path, tok, text_dir, 8, bos=None)
    np.testing.assert_allclose(again["loss"][0], nll / count, rtol=2e-5)
    assert abs(again["loss"][0] - row["loss"][0]) > 1e-3
    model = hf.from_pretrained(path)
    small = lengths_lib.windowed(model.cfg, 8)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: TransformerLM(small, rngs=nnx.Rngs(0))))
    windowed = nnx.merge(graphdef, nnx.state(model))
    assert fams["tiny-llama+window"]["loss"][0] == again["loss"][0]
    nll, count, _ = _direct(path, tok, text_dir, 16, bos=None, model=windowed)
    np.testing.assert_allclose(fams["tiny-llama+window"]["loss"][1], nll / count, rtol=2e-5)
    assert abs(fams["tiny-llama+window"]["loss"][1] - again["loss"][1]) > 1e-4
    # The SelfExtend row: the checkpoint itself at L, past L its parameters under the remap of
    # w = L / 2 = 4 and the group that keeps 16 tokens' far distances below 8 (g = 4).
    remap = {"type": "self_extend", "window": 4, "group": 4}
    graphdef = nnx.graphdef(
        nnx.eval_shape(lambda: TransformerLM(model.cfg.replace(rope_remap=remap), rngs=nnx.Rngs(0)))
    )
    extended = fams["tiny-llama+self_extend"]
    assert extended["loss"][0] == again["loss"][0]
    nll, count, _ = _direct(
        path, tok, text_dir, 16, bos=None, model=nnx.merge(graphdef, nnx.state(model))
    )
    np.testing.assert_allclose(extended["loss"][1], nll / count, rtol=2e-5)
    assert abs(extended["loss"][1] - again["loss"][1]) > 1e-4

    # A rerun reuses every evaluation.
    capsys.readouterr()
    assert experiment.main(_args(path, work, f"--config.data.corpus={text_dir}")) == 0
    assert capsys.readouterr().out.count("reused") >= 4


@pytest.mark.parametrize(
    "change, named",
    [
        (lambda p: shutil.rmtree(p), "is not a directory"),
        (lambda p: (p / "tokenizer.json").unlink(), "no tokenizer.json"),
        (lambda p: (p / "config.json").write_text(json.dumps({"model_type": "t5"})), "t5"),
    ],
)
def test_a_bad_checkpoint_fails_before_compute(tmp_path, capsys, change, named):
    text_dir = _text_dir(tmp_path)
    path, _ = _checkpoint(tmp_path, text_dir)
    change(path)
    argv = _args(path, tmp_path / "run", f"--config.data.corpus={text_dir}")
    assert experiment.main(argv) == 2
    assert named in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_rope_scalings_of_a_checkpoint_without_rope_are_refused(tmp_path, capsys):
    text_dir = _text_dir(tmp_path)
    path, _ = _checkpoint(tmp_path, text_dir)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(ROOT / "tests" / "hf" / "goldens" / "mpt" / name, path / name)
    argv = _args(path, tmp_path / "run", f"--config.data.corpus={text_dir}")
    assert experiment.main(argv) == 2
    assert "not RoPE; set config.rope_scalings=()" in capsys.readouterr().err
    argv = [*argv, "--config.rope_scalings=()", "--config.eval.attention_windows=0"]
    assert experiment.main(argv) == 0
    found = json.loads((tmp_path / "run" / "results.json").read_text())
    assert found["pretrained"]["train_len"] == 8 and found["pretrained"]["bos"] == 1
    assert found["families"]["tiny-llama"]["bits_per_byte"][1] is not None


def test_a_checkpoint_with_its_own_rope_scaling_takes_remaps_but_no_scaling(tmp_path, capsys):
    """A Llama 3 checkpoint: an eval-time scaling would replace its llama3 scaling (refused
    before compute); ReRoPE keeps it, so its row runs."""
    text_dir = _text_dir(tmp_path)
    path, _ = _checkpoint(tmp_path, text_dir)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(ROOT / "tests" / "hf" / "goldens" / "rope_llama3" / name, path / name)
    argv = _args(path, tmp_path / "run", f"--config.data.corpus={text_dir}")
    argv += ["--config.eval.attention_windows=0"]
    assert experiment.main([*argv, "--config.rope_scalings=('yarn','rerope')"]) == 2
    err = capsys.readouterr().err
    assert "config.rope_scalings ('yarn',)" in err and "already has the rope_scaling" in err
    assert not (tmp_path / "run").exists()
    assert experiment.main([*argv, "--config.rope_scalings=('rerope',)"]) == 0
    fams = json.loads((tmp_path / "run" / "results.json").read_text())["families"]
    plain, remapped = fams["tiny-llama"]["loss"], fams["tiny-llama+rerope"]["loss"]
    assert remapped[0] == plain[0] and abs(remapped[1] - plain[1]) > 1e-4


def test_bos_rule_and_bos_windows(tmp_path):
    from posattn.eval import heldout, tokenized

    text_dir = _text_dir(tmp_path)
    path, tok = _checkpoint(tmp_path, text_dir)
    bos = tok.token_to_id("<s>")
    assert tokenized.bos_token(path, tok)[0] == bos  # the post-processor's <s>
    (path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False}))
    assert tokenized.bos_token(path, tok)[0] is None  # tokenizer_config.json decides first
    (path / "tokenizer_config.json").write_text(
        json.dumps({"add_bos_token": True, "bos_token": {"content": "<unk>"}})
    )
    assert tokenized.bos_token(path, tok)[0] == tok.token_to_id("<unk>")

    text = tokenized.tokenize_held_out(data.load_corpus(str(text_dir)), tok, name="t")
    assert text.token_bytes.sum() == text.info["bytes"] > text.info["tokens"]
    held = heldout.held_out_units(text.corpus, block=64)
    plan = heldout.make_plan(held, max_len=16, tokens=64, sliding_tokens=32, stride=8, seed=0)
    with_bos = tokenized.with_bos(plan, bos)
    assert with_bos.fingerprint != plan.fingerprint
    for method, args in (("windows", (text.corpus.val, 8)), ("sliding", (text.corpus.val, 16))):
        a, b = getattr(plan, method)(*args)[0], getattr(with_bos, method)(*args)[0]
        assert (b[:, 0] == bos).all() and (a[:, 1:] == b[:, 1:]).all()


# The fine-tune rows: 3 steps of 4 windows of 2L = 16 tokens, under linear and YaRN of factor 2.
FINETUNE = (
    "--config.finetune.enabled=True",
    "--config.finetune.kinds=('linear','yarn')",
    "--config.finetune.multiple=2",
    "--config.finetune.steps=3",
    "--config.finetune.batch_size=4",
    "--config.finetune.learning_rate=1e-3",
    "--config.finetune.warmup_steps=1",
    "--config.eval.attention_windows=0",
)


@pytest.fixture(scope="module")
def tuned(tiny, tmp_path_factory):
    """The experiment with its fine-tune rows, run once: (argv, workdir, results.json)."""
    text_dir, path, _ = tiny
    work = tmp_path_factory.mktemp("tuned") / "run"
    argv = _args(path, work, f"--config.data.corpus={text_dir}", *FINETUNE)
    assert experiment.main(argv) == 0
    return argv, work, json.loads((work / "results.json").read_text())


def _run_config(run_dir):
    """A fine-tune's config.json as a config (JSON's lists back to tuples)."""
    import ml_collections

    def tuples(x):
        if isinstance(x, dict):
            return {k: tuples(v) for k, v in x.items()}
        return tuple(tuples(v) for v in x) if isinstance(x, list) else x

    return ml_collections.ConfigDict(tuples(json.loads((run_dir / "config.json").read_text())))


def _tune_dirs(work):
    return sorted((work / "tiny-llama" / "finetune").iterdir())


def _scaled_checkpoint(tmp_path, path, scaling):
    """The checkpoint with `scaling` written into its config.json (read back by posattn.hf)."""
    out = tmp_path / f"scaled-{scaling['rope_type']}"
    shutil.copytree(path, out)
    hf_config = json.loads((out / "config.json").read_text())
    hf_config["rope_parameters"] = {"rope_theta": 10000.0, **scaling}
    hf_config["max_position_embeddings"] = 16  # = factor x original, as a YaRN config says
    (out / "config.json").write_text(json.dumps(hf_config))
    return out


def test_finetune_rows_equal_their_own_parameters_and_differ_from_the_checkpoint(
    tmp_path, tiny, tuned
):
    from flax import nnx

    from posattn.train import restore_trained

    text_dir, path, tok = tiny
    _, work, found = tuned
    rows = found["families"]
    assert set(rows) == {
        "tiny-llama",
        "tiny-llama+yarn",
        "tiny-llama+linear+ft",
        "tiny-llama+yarn+ft",
    }
    bos = tok.token_to_id("<s>")
    records = found["pretrained"]["finetune"]
    assert set(records) == {"linear", "yarn"}
    assert [d.name.split("-")[0] for d in _tune_dirs(work)] == ["linear", "yarn"]
    for kind, record in records.items():
        assert record["row"] == f"tiny-llama+{kind}+ft"
        assert (record["steps"], record["multiple"], record["length"]) == (3, 2, 16)
        assert np.isfinite(record["first_train_loss"]) and np.isfinite(record["final_train_loss"])
        assert record["seconds"] > 0
        run_dir = work / "tiny-llama" / "finetune" / pathlib.Path(record["workdir"]).name
        lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [x["step"] for x in lines if "loss" in x] == [1, 2, 3]
        assert record["first_train_loss"] == lines[0]["loss"]
        # The row = the run's final parameters read under the fine-tune's scaling, computed here
        # through posattn.hf with that scaling in config.json.
        run_config = _run_config(run_dir)
        assert run_config.model.init_from == f"hf:{path}"
        assert run_config.data.seq_len == 16 and run_config.data.passkey_fraction == 0
        _, state, step = restore_trained(run_config, run_dir / "checkpoints")
        assert step == 3
        scaling = {"rope_type": kind, "factor": 2.0, "original_max_position_embeddings": 8}
        assert record["scaling"] == scaling
        model = hf.from_pretrained(_scaled_checkpoint(tmp_path, path, scaling))
        nnx.update(model, state["params"])
        for i, length in enumerate((8, 16)):
            nll, count, nbytes = _direct(path, tok, text_dir, length, bos=bos, model=model)
            row = rows[f"tiny-llama+{kind}+ft"]
            np.testing.assert_allclose(row["loss"][i], nll / count, rtol=2e-5)
            np.testing.assert_allclose(
                row["bits_per_byte"][i], nll / (np.log(2) * nbytes), rtol=2e-5
            )
            for other in ("tiny-llama", "tiny-llama+yarn"):
                assert abs(row["loss"][i] - rows[other]["loss"][i]) > 1e-3, (kind, other, length)
    assert rows["tiny-llama+linear+ft"]["loss"] != rows["tiny-llama+yarn+ft"]["loss"]
    md = (work / "results.md").read_text()
    assert "### Fine-tunes" in md and "| tiny-llama+yarn+ft | 3 | 16 | 4 |" in md
    assert "| tiny-llama+linear+ft |" in md.split("### Fine-tunes")[0]  # in the loss tables


def test_the_finetune_reads_the_training_files_and_starts_from_the_checkpoint(tiny, tuned):
    """The token files hold the training files' tokens (BOS before each), and the first step's
    loss is `train_step`'s on the checkpoint's own parameters and the run's first batch."""
    import jax
    from flax import nnx

    from posattn import config as config_lib
    from posattn.data import batches
    from posattn.nn.model import TransformerLM
    from posattn.train import steps

    text_dir, path, tok = tiny
    _, work, found = tuned
    text = found["pretrained"]["finetune_text"]
    corpus = data.load_corpus(text["directory"])
    held_out = data.load_corpus(str(text_dir)).val.tobytes()
    bos = tok.token_to_id("<s>")
    expected, files = [], 0
    for file in sorted(text_dir.iterdir()):
        content = file.read_bytes()
        if content in held_out:
            continue
        files += 1
        expected += [bos, *tok.encode(content.decode(), add_special_tokens=False).ids]
    assert text["train_files"] == files == 5 and text["dtype"] == "uint16"
    assert corpus.train.dtype == np.uint16
    np.testing.assert_array_equal(np.asarray(corpus.train), expected)

    record = found["pretrained"]["finetune"]["linear"]
    run_config = _run_config(pathlib.Path(record["workdir"]))
    cfg = config_lib.validate(run_config)
    assert cfg.d_model == 32 and cfg.settings.scaling_dict["factor"] == 2.0
    optim = steps.OptimConfig.from_config(run_config.train)
    tx = steps.make_optimizer(optim)
    state = steps.init_train_state(cfg, tx, jax.random.key(0))
    state = {**state, "params": hf.load_params(path, cfg)}
    options = batches.batch_options(run_config.data, causal=True, vocab_size=cfg.vocab_size)
    # Step s (from 1) reads the batch stream's batch s + data.batch_offset (0 here).
    batch = batches.train_batch(
        corpus, seed=int(run_config.train.seed), step=1, batch_size=4, seq_len=16, **options
    )

    graphdef = nnx.graphdef(nnx.eval_shape(lambda: TransformerLM(cfg, rngs=nnx.Rngs(params=0))))
    step = jax.jit(lambda state, batch: steps.train_step(graphdef, optim, state, batch))
    _, metrics = step(state, batch)
    np.testing.assert_allclose(float(metrics["loss"]), record["first_train_loss"], rtol=1e-5)


def test_a_rerun_reuses_the_finetunes_their_evaluations_and_the_token_files(tiny, tuned, capsys):
    argv, work, found = tuned
    token_dir = pathlib.Path(found["pretrained"]["finetune_text"]["directory"])
    stamps = {p: p.stat().st_mtime_ns for p in token_dir.iterdir()}
    metrics = {d: (d / "metrics.jsonl").read_text() for d in _tune_dirs(work)}
    capsys.readouterr()
    assert experiment.main(argv) == 0
    out = capsys.readouterr().out
    assert "fine-tune text: reused" in out
    assert out.count("reused the fine-tune") == 2 and "fine-tuning" not in out
    for kind in ("linear", "yarn"):
        assert f"tiny-llama+{kind}+ft loss: reused" in out
    assert {p: p.stat().st_mtime_ns for p in token_dir.iterdir()} == stamps
    assert {d: (d / "metrics.jsonl").read_text() for d in _tune_dirs(work)} == metrics
    again = json.loads((work / "results.json").read_text())
    assert again["families"] == found["families"]
    assert again["pretrained"]["finetune"] == found["pretrained"]["finetune"]

    # Killed after its last checkpoint but before finetuned.json: the rerun resumes the run from
    # that checkpoint (no step trained again), and its evaluations are those of the same params.
    yarn = next(d for d in _tune_dirs(work) if d.name.startswith("yarn-"))
    (yarn / "finetuned.json").unlink()
    assert experiment.main(argv) == 0
    out = capsys.readouterr().out
    assert "tiny-llama+yarn+ft: fine-tuning" in out and "from step 3" in out
    assert "tiny-llama+yarn+ft loss: reused" in out
    assert (yarn / "metrics.jsonl").read_text() == metrics[yarn]
    resumed = json.loads((work / "results.json").read_text())["pretrained"]["finetune"]["yarn"]
    before = found["pretrained"]["finetune"]["yarn"]
    assert {k: v for k, v in resumed.items() if k != "seconds"} == {
        k: v for k, v in before.items() if k != "seconds"
    }


def test_other_finetune_settings_key_another_run_and_evaluation(tiny, tuned):
    """Changed settings (a learning rate, the steps) give another fine-tune directory, and the
    evaluations of the fine-tune rows are keyed by the settings and the parameters."""
    _, path, _ = tiny
    argv, work, found = tuned
    from posattn import cli

    config = cli.parse(experiment.COMMAND, argv).config
    resolved, info = experiment.pretrained.check_pretrained(config)
    from length_extrapolation import pretrained_finetune as ft

    tokens = ft.TrainingTokens(pathlib.Path("t"), {"key": "k"})

    def where(conf):
        tune = ft.tune_config(conf, "linear", tokens.directory)
        return ft.finetune_dir(
            work, "tiny-llama", "linear", ft.settings_of(conf, "linear", tune, "c", tokens)
        )

    base = where(resolved)
    for key, value in (("learning_rate", 2e-3), ("steps", 4), ("warmup_steps", 0), ("multiple", 4)):
        changed = ml_collections.ConfigDict(resolved.to_dict())
        changed.finetune[key] = value
        assert where(changed) != base, key
    saved = json.loads(
        (work / "tiny-llama" / "evaluations" / "tiny-llama+yarn+ft.loss.json").read_text()
    )["key"]["finetune"]
    assert set(saved) == {"settings_sha256", "params_sha256"}
    plain = json.loads((work / "tiny-llama" / "evaluations" / "tiny-llama.loss.json").read_text())
    assert "finetune" not in plain["key"]  # the checkpoint's own rows keep their keys


@pytest.mark.parametrize(
    "case, extra, named",
    [
        (
            "mpt",
            ("--config.rope_scalings=()",),
            "config.finetune.enabled: tiny-llama is a 'alibi' model, not RoPE",
        ),
        ("short", ("--config.finetune.multiple=512",), "fewer than one fine-tune window"),
        (
            "dynamic",
            ("--config.finetune.kinds=('dynamic',)",),
            "config.finetune.kinds has 'dynamic'",
        ),
    ],
)
def test_finetune_refusals_come_before_any_compute(tmp_path, capsys, tiny, case, extra, named):
    text_dir, source, _ = tiny
    path = tmp_path / "tiny-llama"
    shutil.copytree(source, path)
    if case == "mpt":
        for name in ("config.json", "model.safetensors"):
            shutil.copy(ROOT / "tests" / "hf" / "goldens" / "mpt" / name, path / name)
    argv = _args(path, tmp_path / "run", f"--config.data.corpus={text_dir}", *FINETUNE, *extra)
    assert experiment.main(argv) == 2
    err = capsys.readouterr().err
    assert named in err, err
    if case != "dynamic":
        assert "config.finetune.enabled=False" in err or "config.finetune.multiple" in err
    assert not (tmp_path / "run").exists()  # no token files, no fine-tune, no evaluation


def test_token_files_of_ids_past_65535_are_uint32(tmp_path, tiny):
    from length_extrapolation import pretrained_finetune as ft
    from tokenizers import Tokenizer, models, pre_tokenizers

    from posattn import config as config_lib

    text_dir, _, _ = tiny
    vocab = {"<unk>": 0, **{w: 70000 + i for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    config = ml_collections.ConfigDict(
        {"finetune": {"multiple": 2}, "data": {"seq_len": 8, "corpus": str(text_dir)}}
    )
    corpus = data.load_corpus(str(text_dir))
    made = ft.training_tokens(config, tok, None, corpus, tmp_path, "w", config_lib.ConfigError)
    assert sorted(p.name for p in made.directory.iterdir()) == [
        "tokens.json",
        "train.u32.bin",
        "val.u32.bin",
    ]
    tokens = data.load_corpus(str(made.directory))
    assert tokens.train.dtype == np.uint32 and int(tokens.train.max()) >= 70000
    val_text = corpus.val.tobytes().decode()
    np.testing.assert_array_equal(np.asarray(tokens.val), tok.encode(val_text).ids)
    assert made.info["train_tokens"] == tokens.train.size and made.info["dtype"] == "uint32"
    again = ft.training_tokens(config, tok, None, corpus, tmp_path, "w", config_lib.ConfigError)
    assert again.directory == made.directory and again.info == made.info
