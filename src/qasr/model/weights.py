"""Find a checkpoint and read its safetensors, keys of either layout mapped onto the release's minus ``thinker.``;
the weights stay views of the mapped files, and a packer lets a weight's pages go once it holds its own copy."""

from __future__ import annotations

import ctypes
import functools
import json
import mmap
import os
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from qasr.model.asr_model import Qwen3ASRModel
from qasr.model.config import ModelConfig

_HF_PREFIXES = (
    ("model.multi_modal_projector.linear_1.", "audio_tower.proj1."),
    ("model.multi_modal_projector.linear_2.", "audio_tower.proj2."),
    ("model.audio_tower.", "audio_tower."),
    ("model.language_model.", "model."),
    ("lm_head.", "lm_head."),
    ("score.", "lm_head."),  # the aligner's classifier (Qwen3ASRForTokenClassification)
)


def map_key(key: str, layout: str) -> str | None:
    """Checkpoint key -> module key, or None for tensors the model does not use."""
    if layout == "original":
        return key[len("thinker."):] if key.startswith("thinker.") else None
    for src, dst in _HF_PREFIXES:
        if key.startswith(src):
            return dst + key[len(src):]
    return None


def resolve_model_dir(name_or_path: str | os.PathLike) -> Path:
    """A local directory, else the local Hugging Face cache, else a download (when online)."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} has no config.json: not a Qwen3-ASR checkpoint directory")
        return path
    name = str(name_or_path)
    if path.exists():
        raise FileNotFoundError(f"model {name}: a file, not a checkpoint directory")
    if not _looks_like_hub_id(name):  # '/models/x', './x', '~/x': a local path, never a hub look-up
        raise FileNotFoundError(f"model {name}: no such checkpoint directory")
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.txt", "*.model"]
    try:
        return Path(snapshot_download(name, allow_patterns=patterns, local_files_only=True))
    except Exception:
        pass
    try:
        return Path(snapshot_download(name, allow_patterns=patterns))
    except Exception as exc:
        raise FileNotFoundError(
            f"model {name}: no such local directory, not in the local Hugging Face cache, and it could not be "
            f"downloaded ({type(exc).__name__}). On an offline machine, copy the checkpoint directory here and pass "
            f"its path, e.g. ASR.from_pretrained('/models/{name.split('/')[-1]}') or `qasr ... -m PATH`."
        ) from exc


def _looks_like_hub_id(name: str) -> bool:
    """``owner/name``; anything path-like is a local path, and its error says so."""
    owner, _, repo = name.partition("/")
    return name.count("/") == 1 and bool(owner) and bool(repo) and not owner.startswith((".", "~")) and "\\" not in name


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / s for s in shards]
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    found = sorted(model_dir.glob("*.safetensors"))
    if not found:
        raise FileNotFoundError(f"{model_dir} holds no .safetensors weights")
    return found


_PAGE = mmap.PAGESIZE
_PRESENT, _FILE_OR_SHARED = 1 << 63, 1 << 61  # /proc/self/pagemap entry bits


def _whole_pages(t: torch.Tensor) -> tuple[int, int]:
    """The page-aligned address range inside a contiguous CPU tensor's bytes (empty if none)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        return 0, 0
    first = t.data_ptr()
    start, end = -(-first // _PAGE) * _PAGE, (first + t.numel() * t.element_size()) // _PAGE * _PAGE
    return (start, end) if end > start else (0, 0)


def _page_flags(start: int, end: int) -> np.ndarray | None:
    """The pagemap entries of the pages in [start, end), or None where the kernel does not say (not Linux)."""
    try:
        fd = os.open("/proc/self/pagemap", os.O_RDONLY)
    except OSError:
        return None
    try:
        raw = os.pread(fd, (end - start) // _PAGE * 8, start // _PAGE * 8)
    except OSError:
        return None
    finally:
        os.close(fd)
    return np.frombuffer(raw, dtype=np.uint64)


def resident_bytes(t: torch.Tensor) -> int:
    """Bytes of the whole pages of ``t`` that this process holds in memory now (0 where unknown)."""
    start, end = _whole_pages(t)
    flags = _page_flags(start, end) if end > start else None
    return 0 if flags is None else int(np.count_nonzero(flags & np.uint64(_PRESENT))) * _PAGE


def release_file_pages(t: torch.Tensor) -> int:
    """Drop the whole pages of ``t`` that map a file unchanged from this process's resident memory (Linux):
    they read back from the file when next touched, so no value changes. Private pages (anonymous memory, or a
    mapped weight written in place) are never dropped. Returns the bytes dropped."""
    start, end = _whole_pages(t)
    flags = _page_flags(start, end) if end > start else None
    if flags is None:
        return 0
    mask = np.uint64(_PRESENT | _FILE_OR_SHARED)
    clean = (flags & mask) == mask
    edges = np.flatnonzero(np.diff(np.concatenate(([0], clean.astype(np.int8), [0]))))
    madvise = _madvise()
    dropped = 0
    for lo, hi in zip(edges[::2], edges[1::2], strict=True):
        if madvise(start + int(lo) * _PAGE, int(hi - lo) * _PAGE, mmap.MADV_DONTNEED) == 0:
            dropped += int(hi - lo) * _PAGE
    return dropped


def return_free_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc's malloc_trim; elsewhere nothing): scratch freed
    between the copies made since would otherwise stay resident."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> ctypes._CFuncPtr | None:
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


@functools.cache
def _madvise() -> ctypes._CFuncPtr:
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return madvise


def load_model(model_dir: Path, cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> Qwen3ASRModel:
    """The module built on the meta device, every parameter from the files: on the CPU in the files' own dtype,
    a view of the mapped file (nothing copied; the files must stay unchanged while the model is loaded)."""
    with torch.device("meta"):
        model = Qwen3ASRModel(cfg)
    expected = dict(model.named_parameters())
    state: dict[str, torch.Tensor] = {}
    for file in safetensors_files(model_dir):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():
                name = map_key(key, cfg.layout)
                if name is None or name not in expected:
                    continue
                mapped = f.get_tensor(key)  # safetensors maps the file: a view of its pages
                state[name] = mapped.to(device=device, dtype=dtype)
                if state[name] is not mapped:  # converted or moved: the file's pages are not needed now
                    release_file_pages(mapped)
    tie = cfg.decoder.tie_word_embeddings or "lm_head.weight" not in state
    if tie and not cfg.is_aligner and "model.embed_tokens.weight" in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing = sorted(set(expected) - set(state))
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ValueError(f"{model_dir}: {len(missing)} weights missing from the checkpoint ({shown})")
    for name, tensor in state.items():
        want = expected[name].shape
        if tuple(tensor.shape) != tuple(want):
            raise ValueError(f"{model_dir}: weight {name} has shape {tuple(tensor.shape)}, "
                             f"config implies {tuple(want)}")
    model.load_state_dict(state, strict=True, assign=True)
    model.init_buffers(device)
    return model.eval().requires_grad_(False)
