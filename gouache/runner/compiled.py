"""Compiled denoiser forwards (`--compile`): `torch.compile` of the denoiser, one graph per
padded input shape, beside the eager module it was compiled from.

- **Rows.** Continuous batching changes the row count every step. A forward of one row runs
  its own static graph; a forward of more rows runs a graph whose row dimension is dynamic
  (`torch._dynamo.mark_dynamic`), every other dimension static, so one graph serves every row
  count of a size (dynamo splits it where a kernel's choice depends on the rows: a UNet's
  convolutions at 16), unpadded. The buckets (`CompileConfig.buckets`, vLLM's capture sizes are
  the pattern) then name which row counts the warm-up runs (so that each split is compiled) and
  bound the rows a forward runs compiled. Under CUDA graphs (static shapes), for inputs with a
  Python list per row (Qwen-Image's `img_shapes`) and for segmented adapters (grouped
  convolutions of one group per row), rows are padded (the last repeated)
  up to the bucket and the padding cut from the output instead. Rows are independent in every
  family's denoiser, so neither changes a row's output.
- **Patched UNets** (`patched`). A patched forward of mixed sizes runs the UNet with the
  patched operators installed (`gouache.runner.patch_ops`), its attention reading the layout as
  tensors (`attend_segments`, an operator dynamo does not trace), its patch and image counts
  dynamic: one graph serves every mix of a patch side (two, where dynamo splits the
  convolutions at 16 patches), named by its patch bucket (`patch_bucket`). Under CUDA graphs
  the batch is padded to static patch and image buckets instead (`static_bucket`). The warm-up leaves
  them to the background compiler (`warm_up`'s `later`): a patched graph compiles slowly.
- **Template replays on UNets** (`replayed`). An edit replaying a template runs the UNet with
  its transformer blocks computing the masked tokens only, the layout as data
  (`gouache.templates.unet.ReplayLayout`: each grid's computed tokens, the template's
  activations of every token), the computed counts dynamic with the rows: one graph a size
  and row bucket serves every mask. A step that records a template, or whose load plan runs
  some blocks in full, runs eagerly.
- **Block-cache pieces on UNets** (`block`, on a GPU). Where blocks reuse cached outputs per
  image, the UNet runs eagerly around its blocks, and each block runs compiled on the rows it
  computes, a graph per block (`BlockPiece`) and row bucket: the cache's decisions, which read
  values, are the breaks between the pieces.
- **Adapters in the graph.** Under a server with adapters, `RowSlots` (`gouache.lora.apply`)
  hooks every Linear and Conv2d before compiling; a step with several adapter sets binds each
  module's per-row pairs, padded with the rows (a packed DiT's pieces: every set's pairs, each
  index keeping its own set's columns, `gouache.runner.pieces`), and the graph reads them as
  inputs. A new set of adapted modules or ranks compiles a graph of its own in its step
  (counted).
- **Never silently wrong.** Dynamo does not guard on module hooks, so a hook added after
  compiling (an eager LoRA segment, a ControlNet's residual fill, a Ulysses shard) would be skipped by
  the compiled graph. Each call first checks that the denoiser is as it was compiled: the same
  submodules in their slots, the same attention processors, no hooks added, its forward not
  replaced. A change runs eagerly, counted. Weights changed in place (a merged LoRA) are read
  by the compiled graph as inputs: they need no recompile. (Inductor's `freezing`, which folds
  weights into the graph, would keep the old ones: it is never turned on.)
- **Warm-up.** `warm_up` compiles the shapes the server expects (its sizes at every bucket)
  before it says it is healthy. A shape first met later runs eagerly (reason `compiling`) while
  a child process compiles it into the cache (`gouache.runner.background`), then compiles in its
  next step from there; without a `background` compiler it compiles in its step, which waits
  for it. A thread of this process could not compile it: it would trace the module while the
  step's techniques install their hooks on it. Such graphs are counted
  (`gouache_compile_recompiles_total`) and logged: a steady load of the warmed sizes makes none.
- **A compile failure is not a crash.** A forward whose graph fails to compile or load (a kernel
  left damaged in the cache by a killed process, an unsupported operator) first has the cache
  swept (`gouache.runner.compile_cache`: damaged kernels moved aside) and is tried once more if
  the sweep moved something; if it still fails, its shape runs eagerly from then on, logged once
  with the reason and counted as `compile_failed`, at warm-up or later.
- **The step's path.** The composer says per step whether its techniques allow the compiled
  forward (`step(reason)`: what `gouache.techniques` and the model's `holds` say: CFG halves
  and, where the family's pieces take them, Ulysses shards compile); the step's path and reason
  go to `/metrics`
  (`CompileReport`).
- **Other modules over the same rows** (`Target`): an in-process ControlNet runs as the
  denoiser does, in graphs of dynamic rows keyed by its class (its weights are inputs: every
  ControlNet of one architecture shares them), and its residuals reach the UNet's graph as
  inputs (a tuple of per-row tensors, marked and padded with the rows).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from gouache.config import CompileConfig
from gouache.lora.apply import RowSlots
from gouache.outputs import CompileReport
from gouache.runner import compile_cache
from gouache.runner.background import BackgroundCompiler
from gouache.runner.layout import PatchLayout
from gouache.runner.row_inputs import (
    Inputs,
    count_rows,
    cut_rows,
    describe,
    graph_key,
    has_list,
    mark_rows,
    pad_rows,
    resize_rows,
)
from gouache.templates.unet import ReplayLayout

log = logging.getLogger(__name__)

COMPILE_FAILED = "compile_failed"  # the eager reason of a shape whose graph failed to compile
COMPILING = "compiling"  # the eager reason of a shape a child process compiles (`gouache.runner.background`)


def configure(config: CompileConfig) -> Path:
    """Process-wide settings of a compiled server: where compiled kernels are kept across
    restarts (swept of damaged kernels; returned)."""
    directory = compile_cache.cache_dir(config.cache_dir)
    compile_cache.sweep(directory)
    return directory


_threads = threading.local()  # the recompile limit this thread's dynamo settings were raised to


def room_for(limit: int) -> None:
    """Room for `limit` graphs of a compiled function on the calling thread: dynamo's default
    stops compiling new shapes after 8 and runs them eagerly, unseen. Its settings are the
    thread's own (torch's config modules keep a thread's assignments to that thread), and a
    runner is built on one thread and steps on another (the server's engine thread), where the
    pieces' 9th token bucket ran eagerly before this was set per thread."""
    if getattr(_threads, "limit", 0) >= limit:
        return
    import torch._dynamo

    limit = max(torch._dynamo.config.recompile_limit, limit)
    torch._dynamo.config.recompile_limit = limit
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, limit)
    _threads.limit = limit


def _compile_errors() -> tuple[type[BaseException], ...]:
    """What a graph that fails to compile or to load its kernels raises."""
    import torch._dynamo.exc
    import torch._inductor.exc
    from torch.fx.experimental.symbolic_shapes import ConstraintViolationError

    # ConstraintViolationError: a dimension marked dynamic that the graph turns out to fix
    return (torch._dynamo.exc.TorchDynamoException, torch._inductor.exc.CppCompileError, ConstraintViolationError,
            ImportError, OSError)


class CompiledDenoiser:
    """A denoiser and its compiled forward, used where a step allows it and the shape is ready."""

    def __init__(self, denoiser: nn.Module, config: CompileConfig, device: torch.device, adapters: bool = False):
        """`adapters`: whether steps may segment LoRA adapters (`slots` then holds them)."""
        if config.cuda_graphs and device.type != "cuda":
            raise ValueError(f"--compile-cuda-graphs needs a CUDA device; this model runs on {device.type}")
        self.cache = configure(config)
        self._limit = 64 * len(config.buckets)  # graphs of one function: 64 sizes at every bucket (`room_for`)
        self.denoiser = denoiser
        self.slots = RowSlots(denoiser) if adapters else None  # hooks in place before the structure is taken
        self.buckets = tuple(sorted(config.buckets))
        self._mode = "reduce-overhead" if config.cuda_graphs else None
        self._backend = config.backend
        self._compiled = self.compile(denoiser)
        self.target = Target((), lambda **inputs: self._compiled(**inputs, return_dict=False)[0],
                             lambda **inputs: self.denoiser(**inputs, return_dict=False)[0])
        self._block = self.compile(_call)  # a block of the denoiser (`block`)
        self._controlnet = None  # a ControlNet's forward, compiled when first needed (`controlnet`)
        self.dynamic_rows = not config.cuda_graphs  # CUDA graphs record static shapes: their rows are padded
        self._structure = _Structure(denoiser)
        self._ready: set[tuple] = set()  # input shapes whose graph is compiled
        self._known = compile_cache.known(self.cache)  # keys compiled into the cache by any process (reprs)
        self._failed: dict[tuple, str] = {}  # input shapes whose graph failed to compile: why (they run eagerly)
        self.warm = False  # set once warm_up ended: graphs compiled after it are recompiles
        self._later: set[tuple] = set()  # keys the warm-up left to the background compiler: not recompiles
        self._report = CompileReport()
        self._step: _Step | None = None  # the step running, if any
        # techniques (`gouache.techniques`) this model's graphs hold though the table's `compiles`
        # says no in general (`mixed_sizes` where the family runs packed pieces: `Family.compile`)
        self.holds: frozenset[str] = frozenset()
        self.background: BackgroundCompiler | None = None  # compiles shapes first met while serving
        self.split = None  # a CFG-parallel step's `Halves` (`gouache.parallel.cfg`): calls run this rank's rows
        # a Ulysses step's `SequenceShards` (`gouache.parallel.ulysses`), where `holds` has `parallel`:
        # the family runs the step in its pieces on this rank's shard
        self.shards = None

    def close(self) -> None:
        """Stop a background compile (`gouache.runner.background`) that is running."""
        if self.background is not None:
            self.background.close()

    # -- the forward ---------------------------------------------------------------------

    def __call__(self, rows: Inputs, shared: Inputs, target: Target | None = None):
        """The denoiser's first output for `rows` (one row per forward row) and `shared` inputs:
        compiled where the step allows it and the padded shape is compiled, else eager. With a
        `target`, its output instead (another module's forward over rows: a ControlNet's)."""
        target = target or self.target
        if self.split is not None and not target.tag:  # the denoiser's own forward on this rank's rows
            split, self.split = self.split, None
            try:
                return split.run(lambda **half: self(half, shared), count_rows(rows), **rows)
            finally:
                self.split = split
        n = count_rows(rows)
        padded = self.bucket(n)
        if padded is not None and not self._dynamic(rows):
            inputs = pad_rows(rows, padded - n)
        else:
            inputs = rows
        # segmented adapters bind to the denoiser's own forward (a ControlNet takes none; a block
        # cache, whose blocks run as pieces, never segments: `gouache.techniques`)
        own = not target.tag

        def compiled():
            with self._bind(n, count_rows(inputs)) if own else contextlib.nullcontext():
                return cut_rows(self._call_compiled(target, inputs, shared), n)

        def eager():
            return self.eager(rows, shared) if own else target.eager(**rows, **shared)

        if padded is None:
            return self.run(None, eager, past="rows", inside=target.inside)
        return self.run(replace(self.graph(inputs, shared, target=target), run=compiled), eager, inside=target.inside)

    def eager(self, rows: Inputs, shared: Inputs) -> torch.Tensor:
        """The denoiser's first output, eagerly, with the step's segmented adapters bound to its
        rows (a forward the family runs around the compiled one: a template replay's)."""
        with self._bind(count_rows(rows), count_rows(rows)):
            return self.target.eager(**rows, **shared)

    def patched(self, layout: PatchLayout, rows: Inputs, eager: Callable[[], torch.Tensor]) -> torch.Tensor:
        """A patched UNet's output patches over `layout` (`gouache.runner.patch_ops`; `rows`: its
        `patch_inputs`, one row per patch but the text, one per image), compiled where the step
        allows it, else `eager()`. Its graph takes the layout as data (the halo sources, each
        patch's image, the attention segments), its patch and image counts dynamic: one graph
        serves every mix of a patch side, named by its patch bucket (`patch_bucket`) as a graph
        of dynamic rows is by its row bucket. Where rows are not dynamic (CUDA graphs: static
        shapes) the batch is padded instead (`pad_patches`) to its static patch and image
        buckets (`static_bucket`), one graph each. Adapters segmented over the step (a set on
        every patch: `RowSlots.uniform`) are inputs of the graph (a graph of their own)."""
        if self._per_row_adapters():
            return self.run(None, eager, past="segmented adapters")
        return self.run(self.graph(rows, {}, layout), eager)

    def replayed(self, layout: ReplayLayout, rows: Inputs, shared: Inputs, eager: Callable[[], torch.Tensor]):
        """A UNet's output for `rows` where a template replay computes `layout`'s tokens only
        (`gouache.templates.unet`), compiled where the step allows it, else `eager()`. Its graph
        takes the layout as data (the computed tokens' indices, the template's activations),
        the computed counts dynamic with the rows: one graph serves every mask of a size and row
        bucket (adapters segmented over the step in a graph of their own, as `patched`). Not
        under CUDA graphs (static shapes: its computed tokens are not padded to buckets yet)."""
        if self._per_row_adapters():
            return self.run(None, eager, past="segmented adapters")
        if not self.dynamic_rows:
            return self.run(None, eager, past="template under CUDA graphs")
        return self.run(self.graph(rows, shared, layout), eager)

    def controlnet(self, model: nn.Module, inputs: Inputs) -> list[torch.Tensor]:
        """A ControlNet's residuals over `inputs` (its rows: `gouache.controlnet.model.residuals`),
        compiled as the denoiser is, in graphs of dynamic rows keyed by its class: its weights
        are graph inputs, so every ControlNet of one architecture runs one graph."""
        return self(inputs, {}, self._controlnet_target(model))

    def controlnet_graphs(self, model: nn.Module, forwards: list[tuple[Inputs, Inputs]]) -> list[Graph]:
        """The graphs of `model`'s runs over the rows of `forwards` (the UNet's, as the warm-up
        compiles them), at every row bucket (`row_graphs`)."""
        channels = model.controlnet_cond_embedding.conv_out.out_channels
        examples = [({"sample": rows["sample"], "timestep": rows["timestep"],
                      "encoder_hidden_states": rows["encoder_hidden_states"],
                      "controlnet_cond": rows["sample"].new_zeros(len(rows["sample"]), channels,
                                                                  *rows["sample"].shape[2:]),
                      "added_cond_kwargs": rows["added_cond_kwargs"]}, {}) for rows, _ in forwards]
        return self.row_graphs(examples, self._controlnet_target(model))

    def _controlnet_target(self, model: nn.Module) -> Target:
        from gouache.controlnet.model import forward, skipping_embedding

        if self._controlnet is None:
            self._controlnet = self.compile(forward)
        return Target(("controlnet", type(model).__name__),
                      lambda **inputs: skipping_embedding(model, inputs, self._controlnet),
                      lambda **inputs: skipping_embedding(model, inputs))

    def block(self, block: nn.Module, key: str, per_unit: Sequence[str], arguments: dict):
        """One block of the denoiser over some of its rows (the block cache computing the units
        that changed: `gouache.block_cache.blocks`), compiled as a piece of the forward where
        the step allows it: its `per_unit` arguments are its rows (dynamic), the others shared;
        a graph per block and row bucket, eager between them (the cache's reuse decisions read
        values)."""
        rows = {name: value for name, value in arguments.items() if name in per_unit and value is not None}
        shared = {name: value for name, value in arguments.items() if name not in rows}
        return self(rows, shared, self._block_target(block, key))

    def _block_target(self, block: nn.Module, key: str) -> Target:
        return Target(("block", key), lambda **inputs: self._block(block, **inputs), lambda **inputs: block(**inputs),
                      inside=True, piece=BlockPiece(key))

    def _dynamic(self, rows: Inputs) -> bool:
        """Whether a forward of `rows` runs a graph of dynamic rows (else its rows are padded to
        their bucket): more than one row, not under CUDA graphs, no Python list per row, and no
        adapters segmented per row (their grouped convolutions take the row count as a constant)."""
        return self.dynamic_rows and count_rows(rows) > 1 and not has_list(rows) and not self._per_row_adapters()

    def _per_row_adapters(self) -> bool:
        """Whether the step segments adapters per row (several sets: `RowSlots`), which a graph
        takes per row or by a packed layout, not over patches or a replay's tokens."""
        return self.slots is not None and self.slots.active and not self.slots.uniform

    def run(self, graph: Graph | None, eager: Callable[[], torch.Tensor], past: str | None = None,
            inside: bool = False) -> torch.Tensor:
        """`graph` run compiled where the step allows it and its graph compiled, else `eager()`;
        None with `past`: why the forward has no graph (it is past its kind's largest bucket).
        `inside`: a piece of the denoiser's forward, whose blocks may stand in wrappers."""
        reason = self._eager_reason(past, inside)
        if reason is None and graph is not None:
            reason = COMPILE_FAILED if graph.key in self._failed else self._compiles(graph)
            if reason is None:
                if not inside:
                    self._graphs_begin()
                out = self._compiled_forward(graph)
                if out is not None:
                    self._count(None)
                    return self._kept(out)
                reason = COMPILE_FAILED
        self._count(reason)
        return eager()

    def _graphs_begin(self) -> None:
        """Under CUDA graphs, a new generation of inductor's graph tree: a forward's pieces (the
        same compiled function called block after block) run in one generation, whose outputs
        stay valid until the next begins. Without explicit marks the tree starts one at every
        compiled call, and a piece's output read by a later piece (the time embedding) would be
        overwritten."""
        if self._mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()

    def _kept(self, out):
        """A compiled forward's output as the caller may keep it: under CUDA graphs a copy out of
        the graph's memory (which the next generation's graphs reuse), else itself."""
        if self._mode != "reduce-overhead":
            return out
        return torch.utils._pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, out)

    def _compiles(self, graph: Graph) -> str | None:
        """Why `graph`, not compiled yet, runs eagerly now (None: it compiles in this step)."""
        if graph.key in self._ready:
            return None
        if self.warm and self.background is not None and graph.forward is not None:
            if not self.background.ready(graph.key, graph.forward):
                return COMPILING
            log.info("loading a forward first met while serving (%s), compiled in the background", graph.what)
            return None
        log.warning("compiling a forward first met while serving (%s); add its size to --compile-sizes (or raise "
                    "--compile-graphs where it is listed) to compile it at start", graph.what)
        return None

    def _bind(self, rows: int, padded: int) -> contextlib.AbstractContextManager:
        return self.slots.bind(rows, padded) if self.slots is not None else contextlib.nullcontext()

    def bucket(self, rows: int) -> int | None:
        """The bucket of a forward of `rows` rows: the row count its graph is named and warmed up
        by, and padded to where its rows are not dynamic (None past the largest bucket)."""
        return next((b for b in self.buckets if b >= rows), None)

    def _eager_reason(self, past: str | None, inside: bool = False) -> str | None:
        if self._step is None:
            return "outside a step"
        if self._step.reason is not None:
            return self._step.reason
        if past is not None:
            return past
        if torch.is_grad_enabled():
            return "grad"
        return self._structure.changed(self.denoiser, wrapped=inside)

    def _count(self, reason: str | None) -> None:
        """A forward of the step ran eagerly for `reason` (None: compiled)."""
        if self._step is not None and reason is not None and self._step.why is None:
            self._step.why = reason

    @contextlib.contextmanager
    def step(self, reason: str | None) -> Iterator[None]:
        """One step's forwards; `reason`: why the step's techniques run eagerly (None: they may
        run compiled). The step counts as compiled when it ended and no forward of it ran
        eagerly (one whose blocks all reused their cached outputs ran none)."""
        self._step = step = _Step(reason, why=reason)
        self._graphs_begin()  # a block cache's pieces: a CUDA graph tree's generation per step
        done = False
        try:
            yield
            done = True
        finally:
            self._step = None
            if step.why is not None:
                self._report.eager[step.why] = self._report.eager.get(step.why, 0) + 1
            elif done:
                self._report.compiled += 1

    def take_report(self) -> CompileReport:
        report, self._report = self._report, CompileReport()
        return report

    # -- compiling -----------------------------------------------------------------------

    def row_graphs(self, examples: list[tuple[Inputs, Inputs]], target: Target | None = None) -> list[Graph]:
        """The graphs of each of `examples` ((rows, shared) inputs of one request the server
        expects) at every row bucket that holds its rows (its rows repeated to the bucket): a
        model whose requests take two rows (CFG) warms no one-row graph, which a rare forward of
        one row compiles when first met. With dynamic rows most of them are the graph of a
        smaller bucket, which the warm-up runs once more; the others are where dynamo splits the
        rows. `target`: of another module's forward over rows (a ControlNet's)."""
        return [self.graph(resize_rows(rows, b), shared, target=target) for rows, shared in examples
                for b in self.buckets if b >= count_rows(rows)]

    def replay_graphs(self, examples: list[tuple[Inputs, Inputs]],
                      layout: Callable[[Inputs], ReplayLayout]) -> list[Graph]:
        """The template replays of `examples` ((rows, shared) of one request a size) at every row
        bucket that holds their rows (as `row_graphs`), `layout(rows)` an example layout of
        those rows (`replayed`; none under CUDA graphs, where replays run eagerly)."""
        if not self.dynamic_rows:
            return []
        resized = [(resize_rows(rows, b), shared) for rows, shared in examples for b in self.buckets
                   if b >= count_rows(rows)]
        return [self.graph(rows, shared, layout(rows)) for rows, shared in resized]

    def graph(self, rows: Inputs, shared: Inputs, layout: PatchLayout | ReplayLayout | BlockPiece | None = None,
              target: Target | None = None) -> Graph:
        """The graph of a forward of `rows` (at its bucket's row count, or any count in that
        bucket where rows are dynamic) and `shared` inputs; with a `layout`, of a patched UNet's
        forward over it (`patched`), of a template replay's (`replayed`) or of one block
        (`block`); with a `target`, of its forward (a background child builds the denoiser's and
        its blocks')."""
        if isinstance(layout, BlockPiece):  # a child process rebuilding a block's graph
            from gouache.block_cache.blocks import cacheable_blocks

            parent, name = next((parent, name) for parent, name, key in cacheable_blocks(self.denoiser)
                                if key == layout.key)
            target, layout = self._block_target(getattr(parent, name), layout.key), None
        if isinstance(layout, ReplayLayout):
            bucket = self.bucket(count_rows(rows))
            return Graph(("template",) + graph_key(rows, shared, bucket),
                         functools.partial(self._call_replayed, layout, rows, shared),
                         f"template replay, {describe(rows, bucket)}", (rows, shared, layout))
        if layout is not None and not self.dynamic_rows:
            from gouache.runner.patch_ops import pad_patches

            pad = static_bucket(layout.num_patches), static_bucket(len(layout.order) + 1)
            padded = pad_patches(rows, pad)
            return Graph(("patched", layout.patch) + graph_key(padded, shared),
                         functools.partial(self._call_patched, layout, padded, shared, pad),
                         f"patched, {pad[0]} patches of side {layout.patch}, {pad[1]} images", (rows, shared, layout))
        if layout is not None:
            bucket = patch_bucket(layout.num_patches)
            return Graph(("patched", layout.patch) + graph_key(rows, shared, bucket),
                         functools.partial(self._call_patched, layout, rows, shared),
                         f"patched, {bucket}-{2 * bucket - 1} patches of side {layout.patch}", (rows, shared, layout))
        target = target or self.target
        bucket = self.bucket(count_rows(rows))
        return Graph(target.tag + graph_key(rows, shared, bucket), functools.partial(self._call_compiled, target, rows,
                                                                                shared),
                     " ".join((*target.tag, describe(rows, bucket))),
                     (rows, shared) if not target.tag else (rows, shared, target.piece) if target.piece else None)

    def _call_compiled(self, target: Target, inputs: Inputs, shared: Inputs):
        if not self._dynamic(inputs):
            return target.compiled(**inputs, **shared)
        from torch.fx.experimental.symbolic_shapes import ConstraintViolationError

        n = count_rows(inputs)
        try:
            return target.compiled(**mark_rows(inputs), **shared)
        except ConstraintViolationError as e:  # the model's forward takes its row count as a constant
            log.warning("this denoiser's graph fixes its row count; its rows are padded to their bucket from now on "
                        "(%s)", str(e).splitlines()[0])
            self.dynamic_rows = False
        return cut_rows(target.compiled(**pad_rows(inputs, self.bucket(n) - n), **shared), n)

    def _call_patched(self, layout: PatchLayout, rows: Inputs, shared: Inputs,
                      pad: tuple[int, int] | None = None) -> torch.Tensor:
        from torch._dynamo import mark_dynamic
        from torch.fx.experimental import _config as shapes

        from gouache.runner.patch_ops import patch_unet

        # without duck sizing, two counts that happen to be equal in the mix traced (patches and
        # images, say) do not become one symbol, which the next mix would fail
        with patch_unet(self.denoiser, layout, as_data=True, pad=pad) as index, shapes.patch(use_duck_shape=False):
            if pad is not None:  # static shapes: the padding's outputs dropped
                return self._compiled(**rows, **shared, return_dict=False)[0][:layout.num_patches]
            idx = index.tensors(rows["sample"].device)
            mark_dynamic(idx.neighbours, 1)
            for tensor in (idx.image, idx.caller, idx.per_image, idx.offsets, idx.order):
                mark_dynamic(tensor, 0)
            return self._compiled(**mark_rows(rows), **shared, return_dict=False)[0]

    def _call_replayed(self, layout: ReplayLayout, rows: Inputs, shared: Inputs) -> torch.Tensor:
        from torch._dynamo import maybe_mark_dynamic
        from torch.fx.experimental import _config as shapes

        from gouache.templates.unet import replayed_blocks

        dynamic = self._dynamic(rows)
        for computed in layout.computed.values():  # a count of one would specialize: then it recompiles, counted
            maybe_mark_dynamic(computed, 0)
        if dynamic:
            for tensors in layout.template.values():
                for tensor in tensors:
                    maybe_mark_dynamic(tensor, 0)
        # without duck sizing, computed counts equal by chance to the rows (or to each other)
        # in the mix traced do not become one symbol
        with replayed_blocks(self.denoiser, layout), shapes.patch(use_duck_shape=False):
            return self._compiled(**(mark_rows(rows) if dynamic else rows), **shared, return_dict=False)[0]

    def warm_up(self, graphs: list[Graph], progress: Callable[[str], None] = log.info,
                later: Sequence[Graph] = ()) -> None:
        """Compile `graphs` (the forwards the server expects: `row_graphs`, a family's packed
        pieces) before serving, saying how far it got. `later`: forwards it is likely to meet
        that are slow to compile (a patched UNet's), compiled after the warm-up in the
        background compiler's child (their steps run eagerly, reason `compiling`, until each is
        in the cache), else with `graphs`; as are those of another module than the denoiser (a
        ControlNet's), which the child does not build, and those an earlier process compiled into
        the cache (`compile_cache.known`: a restart loads them before it is healthy)."""
        if self.background is None:
            graphs, later = [*graphs, *later], ()
        # the child builds the denoiser alone: another module's graphs (a ControlNet's) compile
        # here; and those an earlier process compiled into the cache load from it (seconds each)
        here = [graph for graph in later if graph.forward is None or repr(graph.key) in self._known]
        if here:
            progress(f"{len(here)} of the forwards left to the background compile here: their own module's, or "
                     f"already in the compile cache")
        graphs = [*graphs, *here]
        later = [graph for graph in later if all(graph is not other for other in here)]
        start = time.perf_counter()
        for i, graph in enumerate(graphs, 1):
            if graph.key not in self._ready and graph.key not in self._failed:
                began = time.perf_counter()
                self._graphs_begin()
                with torch.no_grad():
                    done = self._compiled_forward(graph) is not None
                took = f"{time.perf_counter() - began:.1f} s"
                progress(f"compiled forward {i}/{len(graphs)} ({graph.what}) in {took}" if done else
                         f"forward {i}/{len(graphs)} ({graph.what}) failed to compile in {took}: it runs eagerly")
        self.warm = True
        self._report.warmup_s += time.perf_counter() - start
        later = [graph for graph in later if graph.key not in self._ready]
        if later:
            self._later.update(graph.key for graph in later)
            self.background.submit({graph.key: graph.forward for graph in later})
            progress(f"{len(later)} more forwards compile in the background: "
                     + ", ".join(graph.what for graph in later))

    def _compiled_forward(self, graph: Graph) -> torch.Tensor | None:
        """The compiled forward's output, or None when its graph failed to compile or load: the
        key then runs eagerly from now on, logged once and counted."""
        try:
            out = self._run_swept(graph.run, foreseen=graph.key in self._later)
        except _compile_errors() as e:
            lines = [line for line in str(e).splitlines() if line.strip()]
            self._failed[graph.key] = f"{type(e).__name__}: {lines[0] if lines else ''}"
            log.error("a compiled forward (%s) failed to compile; it runs eagerly from now on: %s",
                      graph.what, self._failed[graph.key])
            self._report.failed += 1
            return None
        if repr(graph.key) not in self._known:
            self._known.add(repr(graph.key))
            compile_cache.remember(self.cache, repr(graph.key))
        self._ready.add(graph.key)
        return out

    def _run_swept(self, run: Callable[[], torch.Tensor], foreseen: bool = False) -> torch.Tensor:
        """`_run`, tried once more when it failed and a sweep of the compile cache moved a damaged
        kernel aside (so the retry compiles it anew)."""
        try:
            return self._run(run, foreseen)
        except _compile_errors():
            if not compile_cache.sweep(self.cache):
                raise
        return self._run(run, foreseen)

    def _run(self, run: Callable[[], torch.Tensor], foreseen: bool = False) -> torch.Tensor:
        """`run()`, counting the graphs dynamo compiles for it (a new shape, or any guard that
        failed): after the warm-up, recompiles, but for those it left to the background
        compiler (`foreseen`)."""
        import torch._dynamo.utils

        room_for(self._limit)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        out = run()
        new = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs
        self._report.graphs += new
        if self.warm and not foreseen:
            self._report.recompiles += new
        return out

    def compile(self, fn: Callable) -> Callable:
        """`fn` (the denoiser, a ControlNet's forward, a family's packed pieces) compiled as configured."""
        return torch.compile(fn, dynamic=False, mode=self._mode, backend=self._backend)


@dataclass(frozen=True)
class Graph:
    """A compiled forward of one key (its static shapes): `run()` runs it compiled; `what` names
    it in logs; `forward`: its (rows, shared) denoiser inputs and, where it has one, its layout
    (`graph`'s arguments), which a child process can compile it from (`gouache.runner.background`;
    None: a family's piece or a ControlNet's, compiled in this process only)."""

    key: tuple
    run: Callable[[], torch.Tensor]
    what: str
    forward: tuple | None = None


@dataclass(frozen=True)
class Target:
    """A module's forward over rows, run as the denoiser's is (`CompiledDenoiser.__call__`):
    `compiled(**inputs)` through a `torch.compile`d function, `eager(**inputs)` else; its graphs'
    keys and names begin with `tag` (the denoiser's own: empty)."""

    tag: tuple[str, ...]
    compiled: Callable
    eager: Callable
    inside: bool = False  # a piece of the denoiser's forward (one block): its blocks may stand in wrappers
    piece: BlockPiece | None = None  # what a child process rebuilds it from (None: the denoiser's, or not at all)


@dataclass(frozen=True)
class BlockPiece:
    """One block of the denoiser, by its key (`gouache.block_cache.blocks.cacheable_blocks`):
    the layout of a block's graph, which a background child finds in its own denoiser."""

    key: str


@dataclass
class _Step:
    reason: str | None  # why the step's techniques run eagerly (None: they may run compiled)
    why: str | None = None  # why the first eager forward ran eagerly


class _Structure:
    """What a compiled graph assumes of its module: the submodule in each slot, each attention
    processor, the hooks of each module, and the module's own forward."""

    def __init__(self, model: nn.Module):
        self.slots = [(parent, name, child) for parent in model.modules() for name, child in parent._modules.items()]
        self.processors = [(m, m.processor) for m in model.modules() if hasattr(m, "processor")]
        self.hooks = [(m, len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()]

    def changed(self, model: nn.Module, wrapped: bool = False) -> str | None:
        """Why `model` no longer runs as it was compiled (None: it does). `wrapped`: a module
        may stand in a wrapper whose `inner` it is (a piece of the forward runs a block whole)."""
        if "forward" in model.__dict__:
            return "forward replaced"
        if any(parent._modules.get(name) is not child
               and not (wrapped and getattr(parent._modules.get(name), "inner", None) is child)
               for parent, name, child in self.slots):
            return "modules replaced"
        if any(m.processor is not p for m, p in self.processors):
            return "attention processors"
        if any(len(m._forward_hooks) != f or len(m._forward_pre_hooks) != p for m, f, p in self.hooks):
            return "hooks"
        if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
            return "hooks"
        return None


def patch_bucket(patches: int) -> int:
    """The bucket a patched forward of `patches` patches is named and warmed up by: the power
    of two at or below it (a bucket holds 8-15 patches, 16-31, ...: a UNet's convolutions split
    dynamo's graph at 16)."""
    return 1 << (patches.bit_length() - 1)


def static_bucket(count: int) -> int:
    """The static size a patched forward's patch or image count is padded to (CUDA graphs): the
    power of two at or above it."""
    return 1 << max(0, count - 1).bit_length()


def _call(module: nn.Module, **inputs):
    """`module`'s forward: compiled once (`CompiledDenoiser._block`), a graph per module and shapes."""
    return module(**inputs)
