"""Streaming safetensors checkpoint reader: headers first, then one shard at a time.

``CheckpointIndex`` reads only headers (``model.safetensors.index.json`` or the ``*.safetensors``
files) and merges quantized parts into logical ``<module>.weight`` tensors with their dequantized
shapes, so the whole checkpoint can be checked against the model before any data is read.
``iter_checkpoint`` then yields ``(name, tensor)`` shard by shard, dequantizing FP8 block and INT4
pack-quantized weights on the fly (formats in ``quant.py``). Peak host memory is the shard being
read (safetensors maps it) plus whatever the caller keeps.
"""
from __future__ import annotations

import ctypes
import json
import os
import re
from collections import defaultdict
from collections.abc import Container, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from ddtree.models import quant

INDEX_FILE = "model.safetensors.index.json"
_PLAIN_DTYPES = {"F64", "F32", "F16", "BF16"}
_FP8_DTYPE = "F8_E4M3"
_LISTED = 20  # names shown per problem kind before "... and N more"

# Leaf names of the parts of a quantized ``<module>.weight``.
_FP8_SCALE = "weight_scale_inv"
_INT4_PARTS = ("weight_packed", "weight_scale", "weight_shape")
_WEIGHT_PARTS = {"weight", _FP8_SCALE, *_INT4_PARTS}
# Parts of quantization schemes we do not implement (asymmetric, act-order, activation scales).
_UNSUPPORTED_PARTS = {
    "weight_zero_point", "weight_g_idx", "weight_global_scale",
    "input_scale", "input_zero_point", "input_global_scale", "output_scale",
}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as asked; the message names the tensors or files."""


@dataclass(frozen=True)
class QuantSettings:
    """What ``quantization_config`` in config.json says about the weight formats."""

    fp8_block: tuple[int, int] = quant.FP8_BLOCK  # DeepSeek-V3's block when config.json is silent
    int4_group_size: int | None = None  # set only by a compressed-tensors pack-quantized config

    @classmethod
    def from_config(cls, config: Mapping | None) -> QuantSettings:
        """Parse config.json (``quantization_config`` at the top or inside ``text_config``)."""
        config = config or {}
        qc = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
        if not qc:
            return cls()
        method = qc.get("quant_method")
        if method == "fp8":
            if qc.get("fmt", "e4m3") != "e4m3":
                raise CheckpointError(f"quantization_config: FP8 format {qc.get('fmt')!r} is not supported (only e4m3)")
            block = qc.get("weight_block_size", list(quant.FP8_BLOCK))
            if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
                raise CheckpointError(f"quantization_config: weight_block_size must be two positive ints, got {block!r}")
            return cls(fp8_block=(block[0], block[1]))
        if method == "compressed-tensors":
            return cls(int4_group_size=_int4_group_size(qc))
        raise CheckpointError(
            f"quantization_config: quant_method {method!r} is not supported (supported: 'fp8' with "
            "128x128 blocks, 'compressed-tensors' pack-quantized int4)"
        )


def _int4_group_size(qc: Mapping) -> int:
    """The one group size of a weight-only, symmetric, int4, group-strategy pack-quantized config."""
    sizes = set()
    for gname, group in (qc.get("config_groups") or {}).items():
        w = group.get("weights")
        fmt = group.get("format") or qc.get("format")
        bad = []
        if fmt != "pack-quantized":
            bad.append(f"format {fmt!r} (only 'pack-quantized')")
        if w is None or group.get("input_activations") or group.get("output_activations"):
            bad.append("activation quantization (only weight-only)")
        else:
            if w.get("type") != "int" or w.get("num_bits") != 4:
                bad.append(f"{w.get('type')}{w.get('num_bits')} weights (only int4)")
            if not w.get("symmetric", False):
                bad.append("asymmetric weights (only symmetric)")
            if w.get("strategy") != "group" or not isinstance(w.get("group_size"), int) or w["group_size"] <= 0:
                bad.append(f"strategy {w.get('strategy')!r} group_size {w.get('group_size')!r} (only 'group')")
            if w.get("actorder") not in (None, False):
                bad.append(f"actorder {w.get('actorder')!r} (only none)")
        if bad:
            raise CheckpointError(f"quantization_config group {gname!r}: unsupported " + "; ".join(bad))
        sizes.add(w["group_size"])
    if len(sizes) != 1:
        raise CheckpointError(f"quantization_config: need exactly one int4 group size across config_groups, got {sorted(sizes)}")
    return sizes.pop()


@dataclass(frozen=True)
class _Part:
    """One tensor on disk."""

    file: Path
    key: str
    dtype: str  # safetensors dtype string, e.g. "BF16", "F8_E4M3", "I32"
    shape: tuple[int, ...]


@dataclass(frozen=True)
class _Entry:
    """One logical tensor: a plain tensor or the parts of a quantized weight."""

    name: str
    kind: str  # "plain" | "fp8" | "int4"
    shape: tuple[int, ...]  # logical (dequantized) shape
    parts: tuple[tuple[str, _Part], ...]  # role -> part; the first part decides the shard

    @property
    def file(self) -> Path:
        return self.parts[0][1].file


def _natural_key(name: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _listing(kind: str, items: list[str]) -> str:
    shown = ", ".join(items[:_LISTED])
    more = f", ... and {len(items) - _LISTED} more" if len(items) > _LISTED else ""
    return f"  {len(items)} {kind}: {shown}{more}"


def _read_json(path: Path, what: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {what} {path}: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{what} {path} is not a JSON object")
    return data


def _open(path: Path):
    try:
        return safe_open(str(path), framework="pt")
    except Exception as e:  # SafetensorError, OSError: corrupt or unreadable file
        raise CheckpointError(f"cannot read safetensors file {path}: {e}") from None


class CheckpointIndex:
    """Names, shapes and formats of a checkpoint's tensors, from headers only.

    ``prefix`` is stripped from on-disk names (kimi_k25: ``"language_model."``); names without it
    are kept whole, so ``check_names`` reports them. Names starting with one of
    ``ignore_prefixes`` (on disk or after stripping) are skipped (vision tower, MTP layers).
    ``config`` overrides the config.json next to the weights (its ``quantization_config``).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        prefix: str = "",
        ignore_prefixes: tuple[str, ...] = (),
        *,
        config: Mapping | None = None,
    ):
        path = Path(path)
        if not path.exists():
            raise CheckpointError(f"checkpoint path {path} does not exist")
        self.root = path if path.is_dir() else path.parent
        if config is None and (self.root / "config.json").is_file():
            config = _read_json(self.root / "config.json", "config")
        self.quant = QuantSettings.from_config(config)
        self.prefix, self.ignore_prefixes = prefix, tuple(ignore_prefixes)
        problems: list[str] = []
        parts = self._read_headers(path, problems)
        self._entries = self._merge_parts(parts, problems)
        if problems:
            more = [f"  ... and {len(problems) - _LISTED} more problems"] if len(problems) > _LISTED else []
            raise CheckpointError(f"checkpoint {self.root} cannot be loaded:\n" + "\n".join(problems[:_LISTED] + more))
        self.files = tuple(sorted({e.file for e in self._entries.values()}))

    # -- reading ---------------------------------------------------------------------------------

    def _shard_map(self, path: Path) -> dict[Path, list[str] | None]:
        """file -> the keys the index assigns to it (None: every key in the file)."""
        if path.is_file() and path.suffix == ".safetensors":
            return {path: None}
        index = path if path.is_file() else self.root / INDEX_FILE
        if index.is_file():
            weight_map = _read_json(index, "index").get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"index {index} has no weight_map")
            by_name: dict[str, list[str]] = defaultdict(list)
            for key, file in weight_map.items():
                by_name[file].append(key)
            shards = {self.root / file: keys for file, keys in by_name.items()}
            absent = sorted(str(f.name) for f in shards if not f.is_file())
            if absent:
                raise CheckpointError(f"index {index} names shard files that do not exist:\n" + _listing("missing files", absent))
            return dict(shards)
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
        if not files:
            raise CheckpointError(f"no {INDEX_FILE} or *.safetensors file at {path}")
        return {f: None for f in files}

    def _read_headers(self, path: Path, problems: list[str]) -> dict[str, _Part]:
        parts: dict[str, _Part] = {}
        not_in_file: list[str] = []
        for file, keys in sorted(self._shard_map(path).items()):
            with _open(file) as f:
                present = set(f.keys())
                for key in sorted(present) if keys is None else keys:
                    if key not in present:
                        not_in_file.append(f"{key} (index says {file.name})")
                        continue
                    if key in parts:
                        problems.append(f"  tensor {key} is in both {parts[key].file.name} and {file.name}")
                        continue
                    s = f.get_slice(key)
                    parts[key] = _Part(file, key, s.get_dtype(), tuple(s.get_shape()))
        if not_in_file:
            problems.append(_listing("tensors missing from their shard", not_in_file))
        return parts

    def _logical(self, key: str) -> str | None:
        name = key[len(self.prefix):] if self.prefix and key.startswith(self.prefix) else key
        if any(key.startswith(p) or name.startswith(p) for p in self.ignore_prefixes):
            return None
        return name

    def _merge_parts(self, parts: dict[str, _Part], problems: list[str]) -> dict[str, _Entry]:
        """Group ``<module>.weight*`` parts into logical weights; validate formats and shapes."""
        modules: dict[str, dict[str, _Part]] = defaultdict(dict)
        entries: dict[str, _Entry] = {}
        bad_dtype, unsupported = [], []
        for key, part in parts.items():
            name = self._logical(key)
            if name is None:
                continue
            module, _, leaf = name.rpartition(".")
            if leaf in _WEIGHT_PARTS and module:
                modules[module][leaf] = part
            elif leaf in _UNSUPPORTED_PARTS:
                unsupported.append(f"{key} (a {leaf} part: asymmetric, act-order or activation quantization)")
            elif part.dtype in _PLAIN_DTYPES:
                entries[name] = _Entry(name, "plain", part.shape, (("data", part),))
            else:
                bad_dtype.append(f"{key} ({part.dtype})")
        int4_shapes = self._read_int4_shapes(modules, problems)
        for module, leaves in sorted(modules.items(), key=lambda kv: _natural_key(kv[0])):
            entry = self._weight_entry(module + ".weight", leaves, int4_shapes.get(module), problems, bad_dtype)
            if entry is not None:
                entries[entry.name] = entry
        if bad_dtype:
            problems.append(_listing("tensors of an unsupported dtype (plain weights must be F32/F16/BF16/F64)", sorted(bad_dtype, key=_natural_key)))
        if unsupported:
            problems.append(_listing("tensors of an unsupported quantization scheme", sorted(unsupported, key=_natural_key)))
        return dict(sorted(entries.items(), key=lambda kv: _natural_key(kv[0])))

    def _read_int4_shapes(self, modules: dict[str, dict[str, _Part]], problems: list[str]) -> dict[str, tuple[int, int]]:
        """The only data read at index time: each INT4 weight's 2-element ``weight_shape``."""
        by_file: dict[Path, list[tuple[str, _Part]]] = defaultdict(list)
        for module, leaves in modules.items():
            if "weight_shape" in leaves:
                by_file[leaves["weight_shape"].file].append((module, leaves["weight_shape"]))
        shapes = {}
        for file, items in sorted(by_file.items()):
            with _open(file) as f:
                for module, part in items:
                    value = self._read(f, file, part)
                    if value.dtype.is_floating_point or value.shape != (2,) or bool((value < 0).any()):
                        problems.append(f"  {part.key}: weight_shape must be 2 non-negative integers, got {value.tolist()} ({part.dtype})")
                        continue
                    shapes[module] = (int(value[0]), int(value[1]))
        return shapes

    def _weight_entry(
        self,
        name: str,
        leaves: dict[str, _Part],
        int4_shape: tuple[int, int] | None,
        problems: list[str],
        bad_dtype: list[str],
    ) -> _Entry | None:
        """The logical ``<module>.weight`` made of ``leaves``, or None after noting the problem."""
        has = set(leaves)
        where = ", ".join(sorted(p.key for p in leaves.values()))
        if "weight_packed" in has:
            if has != set(_INT4_PARTS):
                problems.append(f"  {name}: INT4 pack-quantized weight needs exactly {', '.join(_INT4_PARTS)}; found {where}")
                return None
            if self.quant.int4_group_size is None:
                problems.append(f"  {name}: INT4 pack-quantized tensors but config.json has no compressed-tensors quantization_config")
                return None
            if int4_shape is None:
                return None  # already reported by _read_int4_shapes
            packed, scale = leaves["weight_packed"], leaves["weight_scale"]
            want_packed = quant.int4_packed_shape(int4_shape)
            want_scale = quant.int4_scale_shape(int4_shape, self.quant.int4_group_size)
            if packed.dtype != "I32" or packed.shape != want_packed or scale.dtype not in _PLAIN_DTYPES or scale.shape != want_scale:
                problems.append(
                    f"  {name}: INT4 parts do not fit weight_shape {int4_shape} with group "
                    f"{self.quant.int4_group_size}: weight_packed {packed.dtype}{list(packed.shape)} "
                    f"(want I32{list(want_packed)}), weight_scale {scale.dtype}{list(scale.shape)} (want float{list(want_scale)})"
                )
                return None
            return _Entry(name, "int4", int4_shape, (("packed", packed), ("scale", scale), ("shape", leaves["weight_shape"])))
        if _FP8_SCALE in has:
            weight, scale = leaves.get("weight"), leaves[_FP8_SCALE]
            if has != {"weight", _FP8_SCALE}:
                problems.append(f"  {name}: FP8 weight needs exactly weight and {_FP8_SCALE}; found {where}")
                return None
            want_scale = quant.fp8_scale_shape(weight.shape, self.quant.fp8_block) if len(weight.shape) == 2 else None
            if weight.dtype != _FP8_DTYPE or want_scale is None or scale.dtype not in _PLAIN_DTYPES or scale.shape != want_scale:
                problems.append(
                    f"  {name}: FP8 parts do not fit {self.quant.fp8_block[0]}x{self.quant.fp8_block[1]} blocks: "
                    f"weight {weight.dtype}{list(weight.shape)} (want {_FP8_DTYPE}, 2-D), "
                    f"{_FP8_SCALE} {scale.dtype}{list(scale.shape)} (want float{list(want_scale) if want_scale else ''})"
                )
                return None
            return _Entry(name, "fp8", weight.shape, (("data", weight), ("scale_inv", scale)))
        if has != {"weight"}:
            problems.append(f"  {name}: incomplete or unsupported quantized weight; found {where}")
            return None
        weight = leaves["weight"]
        if weight.dtype == _FP8_DTYPE:
            problems.append(f"  {name}: FP8 weight {weight.key} has no {_FP8_SCALE}")
            return None
        if weight.dtype not in _PLAIN_DTYPES:
            bad_dtype.append(f"{weight.key} ({weight.dtype})")
            return None
        return _Entry(name, "plain", weight.shape, (("data", weight),))

    # -- queries ---------------------------------------------------------------------------------

    def names(self) -> list[str]:
        """Logical names (prefix stripped, quantized parts merged into ``<x>.weight``), natural order."""
        return list(self._entries)

    def _entry(self, name: str) -> _Entry:
        try:
            return self._entries[name]
        except KeyError:
            raise CheckpointError(f"checkpoint {self.root} has no tensor {name!r}") from None

    def shape(self, name: str) -> tuple[int, ...]:
        """Logical (dequantized) shape."""
        return self._entry(name).shape

    def format(self, name: str) -> str:
        """``"plain"``, ``"fp8"`` or ``"int4"``: how the tensor is stored."""
        return self._entry(name).kind

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    # -- streaming -------------------------------------------------------------------------------

    def iter_tensors(
        self,
        dtype: torch.dtype,
        names: Iterable[str] | None = None,
        device: torch.device | str = "cpu",
        *,
        keep_quantized: Container[str] = (),
    ) -> Iterator[tuple[str, torch.Tensor | quant.QuantizedTensor]]:
        """Yield ``(name, tensor in dtype on device)`` shard by shard; one shard open at a time.

        Dequantization runs on ``device`` (the raw parts are moved there first). Quantized
        weights named in ``keep_quantized`` come as ``quant.QuantizedTensor`` (their parts copied
        to ``device`` as stored) instead. A part stored in another shard (rare) is read through a
        second, short-lived handle.
        """
        if names is None:
            wanted = list(self._entries.values())
        else:
            requested = list(dict.fromkeys(names))
            unknown = sorted((n for n in requested if n not in self._entries), key=_natural_key)
            if unknown:
                raise CheckpointError(f"checkpoint {self.root} lacks requested tensors:\n" + _listing("missing", unknown))
            wanted = [self._entries[n] for n in requested]
        by_file: dict[Path, list[_Entry]] = defaultdict(list)
        for entry in wanted:
            by_file[entry.file].append(entry)
        return self._stream(by_file, dtype, torch.device(device), keep_quantized)  # errors above raise now, not at next()

    def _stream(self, by_file: dict[Path, list[_Entry]], dtype: torch.dtype, device: torch.device,
                keep_quantized: Container[str]):
        for file in sorted(by_file):
            with _open(file) as f:
                for entry in by_file[file]:
                    raw = {role: self._read(f, file, part) for role, part in entry.parts}
                    if entry.kind != "plain" and entry.name in keep_quantized:
                        tensor = self._quantized(entry, raw, device)
                    else:
                        tensor = self._materialize(entry, raw, dtype, device)
                    if entry.kind != "plain" and device.type == "cpu":
                        _release_freed_memory()  # the dequantization temporaries
                    yield entry.name, tensor
                    del raw, tensor

    @staticmethod
    def _read(f, file: Path, part: _Part) -> torch.Tensor:
        try:
            if part.file == file:
                return f.get_tensor(part.key)
            with _open(part.file) as other:
                return other.get_tensor(part.key)
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"cannot read tensor {part.key} from {part.file}: {e}") from None

    def _quantized(self, entry: _Entry, raw: dict[str, torch.Tensor], device: torch.device) -> quant.QuantizedTensor:
        copy = lambda t: t.to(device=device, copy=True)  # noqa: E731  (own memory, not the map)
        if entry.kind == "fp8":
            return quant.QuantizedTensor("fp8", copy(raw["data"]), copy(raw["scale_inv"]).float(), entry.shape,
                                         self.quant.fp8_block)
        return quant.QuantizedTensor("int4", copy(raw["packed"]), copy(raw["scale"]), entry.shape,
                                     (1, self.quant.int4_group_size))

    def _materialize(self, entry: _Entry, raw: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if entry.kind == "plain":
            # Always a copy: a tensor backed by the mapped file would keep the whole shard's
            # mapping (and its resident pages) alive for as long as the caller keeps the tensor.
            return raw["data"].to(device=device, dtype=dtype, copy=True)
        try:
            if entry.kind == "fp8":
                return quant.dequantize_fp8_block(raw["data"].to(device), raw["scale_inv"].to(device), dtype, self.quant.fp8_block)
            return quant.dequantize_int4_group(
                raw["packed"].to(device), raw["scale"].to(device), entry.shape, dtype, self.quant.int4_group_size
            )
        except ValueError as e:
            raise CheckpointError(f"{entry.name}: {e}") from None


def _load_malloc_trim():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


_MALLOC_TRIM = _load_malloc_trim()


def _release_freed_memory() -> None:
    """Hand glibc's free heap pages back to the OS (~0.15 ms). Dequantization temporaries freed
    between tensors the caller keeps leave holes that glibc would otherwise keep resident: about
    two shards' worth when a whole checkpoint is kept on the CPU (benchmarks/bench_loader.py)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def iter_checkpoint(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype,
    prefix: str = "",
    ignore_prefixes: tuple[str, ...] = (),
    names: Iterable[str] | None = None,
    device: torch.device | str = "cpu",
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream a checkpoint as ``(logical name, tensor in dtype)``; see ``CheckpointIndex``."""
    return CheckpointIndex(path, prefix, ignore_prefixes).iter_tensors(dtype, names, device)


def check_names(expected: Mapping[str, tuple[int, ...]], index: CheckpointIndex) -> None:
    """Raise ``CheckpointError`` listing every missing, unexpected and mis-shaped tensor."""
    have = set(index.names())
    missing = sorted(set(expected) - have, key=_natural_key)
    unexpected = sorted(have - set(expected), key=_natural_key)
    misshaped = [
        f"{n} (model {tuple(expected[n])}, checkpoint {index.shape(n)})"
        for n in sorted(set(expected) & have, key=_natural_key)
        if tuple(expected[n]) != index.shape(n)
    ]
    sections = [_listing(kind, items) for kind, items in
                (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped)) if items]
    if sections:
        raise CheckpointError(f"checkpoint {index.root} does not match the model:\n" + "\n".join(sections))
