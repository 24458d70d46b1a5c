"""Compiled decode layers saved across processes (`fast.compiled.CompiledLayers` with a folder): compiled ahead
(`aot_compile`), saved under a digest of what the graph depends on, loaded by a later process instead of traced
again, with the tokens of the layers compiled in the process."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from minimax_ref.fast import compiled as fc
from minimax_ref.generation.decoding import generate_ids
from minimax_ref.generation.sampling import SamplingParams
from minimax_ref.weights.loader import load_model

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = [[5, 9, 2, 7, 11, 3], [4, 8, 1]]

pytestmark = pytest.mark.skipif(not fc.saves_compiled_layers(), reason="this torch does not save compiled functions")


def _tokens(ckpt, **kw):
    model = load_model(ckpt, dtype=torch.float32, weights="packed", fast="compiled", **kw)
    seqs, _ = generate_ids(model, PROMPTS, max_new_tokens=3, sampling=GREEDY)
    return model, [s.generated for s in seqs]


def test_saving_does_not_need_the_aot_flag_on_by_default(tmp_path):
    """torch 2.11 and 2.12 ship with dynamo's `enable_aot_compile` off and attach `aot_compile` only to a function
    wrapped while it is on: a layer set that saves wraps its function with it on."""
    # dynamo's own patch: a monkeypatch's undo hides a config entry on torch 2.11 (its module's delattr)
    with torch._dynamo.config.patch(enable_aot_compile=False):
        assert hasattr(fc.CompiledLayers(None, folder=tmp_path).compiled, "aot_compile")
        assert torch._dynamo.config.enable_aot_compile is False


def test_a_later_process_loads_the_saved_layers(tiny_nvfp4, tmp_path, monkeypatch):
    monkeypatch.setenv("MINIMAX_REF_CACHE", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    model, first = _tokens(tiny_nvfp4)
    folder = tmp_path / "compile" / "layers"
    assert model.compiled.folder == folder
    # one graph per kind of layer (dense MLP, MoE) at this step shape
    assert len(list(folder.glob("*-0.aot"))) == 2 and not list(folder.glob("*-1.aot"))
    # a new model (a new process's state): every graph loaded, none compiled
    monkeypatch.setattr(fc.CompiledLayers, "compile_ahead", lambda *a: pytest.fail("compiled again"))
    again, second = _tokens(tiny_nvfp4)
    assert second == first and sum(len(g) for g in again.compiled.graphs.values()) == 2
    # a saved graph that fails when run (a torch that saves what it cannot run): saving off, compiled in the process
    class Broken:
        def guard_check(self, *args):
            return True

        def __call__(self, *args):
            raise RuntimeError("cannot run here")

    monkeypatch.setattr(torch.compiler, "load_compiled_function", lambda f: Broken())
    broken, fallback = _tokens(tiny_nvfp4)
    assert broken.compiled.folder is None and fallback == first
    # the layers compiled in the process (no folder) choose the same tokens
    monkeypatch.setattr(fc, "saves_compiled_layers", lambda: False)
    plain, third = _tokens(tiny_nvfp4)
    assert plain.compiled.folder is None and third == first


def test_a_graph_whose_guards_refuse_a_layer_gets_a_second_one(tiny_nvfp4, tmp_path, monkeypatch):
    """Two kinds of layer described alike (one digest): the first kind's graph refuses the second (its guards), which
    gets a graph of its own beside it, loaded and chosen by its guards in a later process."""
    monkeypatch.setenv("MINIMAX_REF_CACHE", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setattr(fc.CompiledLayers, "digest", lambda self, layer, rest: "alike")
    _, first = _tokens(tiny_nvfp4)
    folder = tmp_path / "compile" / "layers"
    assert sorted(p.name for p in folder.glob("*.aot")) == ["alike-0.aot", "alike-1.aot"]
    monkeypatch.setattr(fc.CompiledLayers, "compile_ahead", lambda *a: pytest.fail("compiled again"))
    _, second = _tokens(tiny_nvfp4)
    assert second == first


def test_the_digest_reads_shapes_kinds_and_code():
    @dataclasses.dataclass
    class Part:
        k: torch.Tensor
        scale: float

    t = torch.zeros(2, 3)
    assert fc.describe(t) == ("tensor", (2, 3), (3, 1), "torch.float32", "cpu")
    assert fc.describe(Part(t, 1.0)) == ("Part", (("k", fc.describe(t)), ("scale", "1.0")))
    assert fc.describe(torch.nn.Linear(2, 3, bias=False)) == (
        "module", (("", "Linear"),), (("weight", (3, 2), "torch.float32"),))
    assert fc.describe(7) == "7"
    assert len(fc.code_version()) == 16 and fc.code_version() == fc.code_version()


def test_without_saving_the_layers_compile_in_the_process(monkeypatch, tmp_path):
    monkeypatch.setattr(fc, "saves_compiled_layers", lambda: False)
    assert fc.CompiledLayers(None, tmp_path).folder is None


class _ScaledLayer(torch.nn.Module):
    """A layer with a bf16 weight and its compute dtype as an attribute, read by its forward or not."""

    def __init__(self, reads_dtype: bool):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(-1, 1, 16).reshape(4, 4).to(torch.bfloat16),
                                         requires_grad=False)
        self.dtype = torch.bfloat16
        self.reads_dtype = reads_dtype

    def forward(self, x, pos, cos, sin, cache, kv_len):
        y = x @ self.weight
        return y.to(self.dtype) if self.reads_dtype else y


@pytest.mark.parametrize("reads_dtype", [True, False])
def test_every_kept_file_loads_back(tmp_path, reads_dtype, capsys):
    """A saved graph is loaded back before it is kept: a graph whose guards this torch saves but cannot load (a module
    attribute holding a dtype that the forward never reads: torch saves it as missing, and with it every tensor's
    dtype) is used in the process and leaves no file; any file left loads in a new layer set (a later process),
    which compiles nothing."""
    x = torch.linspace(-2, 2, 8).reshape(2, 4).to(torch.bfloat16)
    args = (None, None, None, None, 0)
    layer = _ScaledLayer(reads_dtype)
    want = layer(x, *args)
    first = fc.CompiledLayers(None, folder=tmp_path)
    assert torch.equal(first(layer, x, *args), want)
    files = list(tmp_path.glob("*.aot"))
    assert not list(tmp_path.glob(".*.tmp"))
    if not files:
        assert "does not load back" in capsys.readouterr().err
    later = fc.CompiledLayers(None, folder=tmp_path)
    if files:
        later.compile_ahead = lambda *a: pytest.fail("compiled again")
    assert torch.equal(later(_ScaledLayer(reads_dtype), x, *args), want)
    if reads_dtype:  # the dtype guarded: saved and loaded on every torch
        assert len(files) == 1


def test_a_failed_load_leaves_the_compiler_settings_as_they_were(tmp_path, monkeypatch):
    """A saved graph loads under the layers' inductor options (as they compile: the static launcher off); a load that
    changes a compiler setting and then fails (as torch's can, halfway through a saved graph) has the setting put
    back, so the layers compiled next compile as before."""
    before = torch._inductor.config.max_autotune
    seen = {}

    def half_load(f):
        seen["static launcher"] = torch._inductor.config.use_static_cuda_launcher
        torch._inductor.config.max_autotune = not before
        raise TypeError("halfway")

    monkeypatch.setattr(torch.compiler, "load_compiled_function", half_load)
    path = tmp_path / "graph.aot"
    path.write_bytes(b"")
    layers = fc.CompiledLayers(None, folder=tmp_path)
    with pytest.raises(TypeError, match="halfway"):
        fc._load(path, layers.options)
    assert seen == {"static launcher": False} and layers.options["use_static_cuda_launcher"] is False
    assert torch._inductor.config.max_autotune == before
