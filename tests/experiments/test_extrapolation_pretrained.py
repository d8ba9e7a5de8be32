"""Rows of kind `pretrained`: a tiny committed Hugging Face checkpoint (tests/hf/goldens/llama_gqa)
with a tokenizer built here, evaluated end to end on a tiny text directory; bits per byte and BOS
checked against a direct computation from the tokenizer's offsets and transformers-equal logits."""

import json
import shutil
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT

import posattn.hf as hf
from posattn import data

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


def _direct(path, tok, text_dir, length, *, bos):
    """(summed NLL, scored tokens, UTF-8 bytes of the scored text) of every non-overlapping
    window of `length` in every chunk of 16 tokens of each held-out file, computed from the
    file's text, the tokenizer's offsets and the model's logits."""
    corpus = data.load_corpus(str(text_dir))
    model = hf.from_pretrained(path)
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
    logits = np.asarray(model(jnp.asarray(windows[:, :-1])), np.float64)  # (W, T, V)
    m = logits.max(-1, keepdims=True)
    logp = logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))
    targets = windows[:, 1:]
    nll = -np.take_along_axis(logp, targets[..., None], axis=-1).sum()
    count = targets.size
    return nll, count, nbytes


def test_a_checkpoint_is_evaluated_per_token_and_per_byte_with_bos(tmp_path, capsys):
    text_dir = _text_dir(tmp_path)
    path, tok = _checkpoint(tmp_path, text_dir)
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

    # Without BOS the windows start in the text: a different loss, again the direct one.
    plain = tmp_path / "plain"
    argv = _args(
        path,
        plain,
        f"--config.data.corpus={text_dir}",
        "--config.pretrained.bos=never",
        "--config.rope_scalings=()",
        "--config.eval.attention_windows=0",
    )
    assert experiment.main(argv) == 0
    again = json.loads((plain / "results.json").read_text())["families"]["tiny-llama"]
    nll, count, _ = _direct(path, tok, text_dir, 8, bos=None)
    np.testing.assert_allclose(again["loss"][0], nll / count, rtol=2e-5)
    assert abs(again["loss"][0] - row["loss"][0]) > 1e-3

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
