"""The experiment's rows, built once from the config.

A row is one model read at every eval length; four kinds, none of them tied to a family's name:

* a trained entry of `families` ("alibi", "fire:fire_init_c=3.2"): the trained model as it is;
* an eval-time RoPE scaling (`rope_scalings`) of any RoPE entry: row `<entry>+<scaling>`
  ("rope+yarn", "rope:rope_base=5e5+yarn"): the entry's trained parameters under the Hugging
  Face `rope_scaling` {type, factor = T / L, original_max_position_embeddings = L} at T > L
  (`posattn.eval.lengths.rope_scaling_row`), the trained model itself at T <= L;
* a fine-tune (`finetune`) of any RoPE entry: row `<entry>+<kind>+ft`: the entry's parameters
  fine-tuned at `finetune.multiple` x L under the fixed scaling of factor `finetune.multiple`,
  read with that scaling at every length (<= L included);
* an eval-time sliding window (`window_rows`) of any entry: row `<entry>+window`: the entry's
  trained parameters with every layer's attention (or the layers of `window_layers`) limited to
  the last L keys at T > L (`posattn.eval.lengths.windowed`): each query sees the distances
  0 .. L - 1 of training and no more; the trained model itself at T <= L, where the window hides
  nothing.

A fifth kind, `pretrained`, is a published checkpoint (`config.pretrained.path`,
`build_pretrained_rows`): row `<name>` reads it as it is, rows `<name>+<scaling>` under each
eval-time `rope_scalings` entry when it is a RoPE model (the factor T / L against the checkpoint's
training length L, as for a trained entry), and with `finetune.enabled` rows
`<name>+<kind>+ft`: the checkpoint fine-tuned under position interpolation or YaRN
(`Row.finetune`, trained and read by `pretrained.Checkpoint.params_of`), and with `window_rows`
= (`<name>`,) row `<name>+window`.

`Row.reads(length)` says which model a row reads at a length (`ModelKey`): rows that read the
same model there (a scaling or window row at T <= L and its trained row) share one evaluation.
All the rows of one RoPE entry read one graph per length (`posattn.eval.lengths.rope_row_model`),
so they share its compiled programs too (`row_model` builds what a key reads).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import ml_collections
from flax import nnx

from posattn.eval import lengths as lengths_lib
from posattn.nn.model import TransformerLM

from .settings import (
    family_config,
    finetune_enabled,
    finetune_scaling,
    is_rotary,
    rope_row_at,
)

__all__ = ["ModelKey", "Row", "build_pretrained_rows", "build_rows", "row_model"]


@dataclasses.dataclass(frozen=True)
class ModelKey:
    """Which model a row reads at one length: the trained entry, its fine-tune kind (None: the
    trained parameters), the rope_scaling it is read with (JSON; "null": its own), the sliding
    window its layers are limited to (None: the model's own) and which layers (None: every one)."""

    entry: str
    finetune: str | None
    scaling: str
    window: int | None = None
    window_layers: tuple[int, ...] | None = None
    remap: str = "null"  # an eval-time RoPE remap (JSON; "null": none)

    def scaling_dict(self) -> dict[str, Any] | None:
        return json.loads(self.scaling)

    def remap_dict(self) -> dict[str, Any] | None:
        return json.loads(self.remap)


@dataclasses.dataclass(frozen=True)
class Row:
    """One row of the results.

    Attributes:
      name: its key in results.json's `families`.
      entry: the `families` entry whose trained models it reads (one per seed).
      train_config: that entry's training config (validated once, shared by its rows).
      scaling: the eval-time `rope_scalings` entry ("yarn:beta_fast=16"), or None.
      finetune: the fine-tune kind ("yarn"), or None.
      window: whether the row reads the model under a sliding window of L.
      window_layers: the layers the window limits (`window_layers`; empty: every layer).
      checkpoint: the Hugging Face checkpoint directory of a `pretrained` row (None: trained).
    """

    name: str
    entry: str
    train_config: ml_collections.ConfigDict = dataclasses.field(compare=False, repr=False)
    scaling: str | None = None
    finetune: str | None = None
    window: bool = False
    window_layers: tuple[int, ...] = ()
    checkpoint: str | None = None

    @property
    def kind(self) -> str:
        """ "pretrained", "finetune", "scaling", "window" or "trained"."""
        if self.checkpoint is not None:
            return "pretrained"
        if self.finetune is not None:
            return "finetune"
        if self.window:
            return "window"
        return "scaling" if self.scaling is not None else "trained"

    @property
    def trained(self) -> bool:
        """Whether the row is its entry's trained model as it is (the row its training makes)."""
        return self.kind == "trained"

    def reads(self, config: ml_collections.ConfigDict, length: int) -> ModelKey:
        """The model this row reads at `length`."""
        L = int(config.data.seq_len)
        scaling = remap = None
        if self.finetune is not None:
            scaling = finetune_scaling(config, self.finetune)
        elif self.scaling is not None:
            scaling, remap = rope_row_at(self.scaling, L, length)
        window = L if self.window and length > L else None
        layers = (self.window_layers or None) if window else None
        scaling, remap = (json.dumps(x, sort_keys=True) for x in (scaling, remap))
        return ModelKey(self.entry, self.finetune, scaling, window, layers, remap)

    def settings(self) -> dict[str, Any]:
        """What identifies the row's numbers besides the code, the text and the parameters."""
        out = {"entry": self.entry, "scaling": self.scaling, "finetune": self.finetune}
        # Only the keys a row has: the other rows keep the keys their caches were made with.
        if self.window:
            out["window"] = True
            if self.window_layers:
                out["window_layers"] = list(self.window_layers)
        if self.checkpoint is not None:
            out["checkpoint"] = self.checkpoint
        return out


def build_rows(config: ml_collections.ConfigDict) -> list[Row]:
    """Every row of the experiment, in results order: each entry of `families`, then for a RoPE
    entry its `rope_scalings` rows and its fine-tune rows, then its window row if `window_rows`
    names it."""
    rows = []
    tune = finetune_enabled(config)
    windows = {str(e) for e in config.get("window_rows", ())}
    layers = tuple(int(i) for i in config.get("window_layers", ()))
    for entry in config.families:
        train_config = family_config(config, entry)
        rows.append(Row(str(entry), str(entry), train_config))
        if is_rotary(entry):
            for scaling in config.rope_scalings:
                rows.append(
                    Row(f"{entry}+{scaling}", str(entry), train_config, scaling=str(scaling))
                )
            for kind in config.finetune.kinds if tune else ():
                rows.append(Row(f"{entry}+{kind}+ft", str(entry), train_config, finetune=kind))
        if str(entry) in windows:
            rows.append(
                Row(f"{entry}+window", str(entry), train_config, window=True, window_layers=layers)
            )
    return rows


def build_pretrained_rows(config: ml_collections.ConfigDict, name: str, rotary: bool) -> list[Row]:
    """The rows of the checkpoint `config.pretrained.path` (named `name`): the checkpoint as it
    is, then, for a RoPE checkpoint (`rotary`), one row per `rope_scalings` entry and, with
    `finetune.enabled`, one per `finetune.kinds` entry; a window row when `window_rows` is
    (`name`,). `config` is the resolved one
    (`data.seq_len` = the checkpoint's training length)."""
    path = str(config.pretrained.path)
    rows = [Row(name, name, None, checkpoint=path)]
    if rotary:
        for scaling in config.rope_scalings:
            rows.append(Row(f"{name}+{scaling}", name, None, scaling=str(scaling), checkpoint=path))
        for kind in config.finetune.kinds if finetune_enabled(config) else ():
            rows.append(Row(f"{name}+{kind}+ft", name, None, finetune=kind, checkpoint=path))
    if tuple(config.get("window_rows", ())) == (name,):
        layers = tuple(int(i) for i in config.get("window_layers", ()))
        rows.append(
            Row(f"{name}+window", name, None, window=True, window_layers=layers, checkpoint=path)
        )
    return rows


def row_model(cfg, graphdef: nnx.GraphDef, constants: nnx.State, key: ModelKey, length: int):
    """(graphdef, constants) of the model `key` names for windows of `length` tokens, given the
    trained model `cfg` (its `graphdef` and `constants`): a RoPE model's rows all read one graph
    at each length (`posattn.eval.lengths.rope_row_model`: the scaling's frequencies as arrays);
    a window (`posattn.eval.lengths.windowed`) changes the graph, never the params or constants.
    Whether the result depends on `length` is `cfg.family.rotary`."""
    if key.window is not None:
        cfg = lengths_lib.windowed(cfg, key.window, key.window_layers)
    if cfg.family.rotary:
        return lengths_lib.rope_row_model(cfg, key.scaling_dict(), length, key.remap_dict())
    if key.window is not None:
        graphdef = nnx.graphdef(nnx.eval_shape(lambda: TransformerLM(cfg, rngs=nnx.Rngs(params=0))))
    return graphdef, constants
