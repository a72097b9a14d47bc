"""Mask-aware edits (InstGenIE §3-4): an edit computes its masked tokens only and takes the
other tokens' activations from a template's recorded ones.

A template is an image that edits come back to (a model photo for virtual try-on, a face for
face swap), named by the id a client gives it or a hash of its upload (of its pixels, offline),
and keyed by its pixels too: an id reused for another picture records a new template rather
than replaying the old picture's activations.
The first edit of it (its *recorder*, or `POST /v1/templates`) runs in full and records, per
step, every transformer block's output and every attention's keys and values, of all image
tokens (and text rows), into the tiered `TemplateStore` (one entry per step). A later edit of
the same template, size, step count and guidance rows (its *key*) computes, in each block,
only the tokens of its own mask and of the recorder's (the common unmasked region is what
they share), and the text rows whose conditioning differs from the recorder's:

- token-wise work (norms, projections, feed-forwards) runs on those tokens only;
- attention takes their queries, with keys and values of every token, the others' from the
  template (InstGenIE's Fig. 7 variant: it stores 3 rather than 2 tensors a token and block,
  and projects no key or value of a token it does not compute);
- the block's output for the other tokens is the template's.

DiTs run it through the packed forward (`pack_dit`), whose blocks and attention already run on
a subset of tokens for the block cache: this module supplies a pass with the block cache's
interface (`select`, `merge`, `end`; `kv` in place of `stale`), and edits of any mask ratio,
recorders and plain requests share one forward. UNets run it in their transformer blocks
(`templates.unet`), with a pass per token grid. When the recorder and the edit are the same request (same seed,
prompt and mask), the template's activations are the ones the full forward would compute, so
the edit is exact; otherwise the unmasked tokens' activations are the template's, an
approximation measured by `gouache bench edit`.

Which blocks of a step replay is InstGenIE's load plan on profiled costs (`plan`); without a
profile, an edit whose tokens to compute cover more than `full_above` of the image runs in full.
A step whose entry the store no longer has (evicted, corrupt, or never recorded: its recorder
was cancelled) runs in full and records it again, never with a wrong activation.
"""

from __future__ import annotations

import hashlib
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from gouache.attention import attention_modules
from gouache.config import TemplateConfig
from gouache.outputs import TemplateReport
from gouache.templates.load_plan import plan_loads
from gouache.templates.store import TemplateStore

MASK = "mask"  # the recorder's own mask [tokens] (uint8) in each step entry: its tokens hold its edit, not the template
TEXT = "text_digest"  # [rows, 16] uint8 in each step entry: the recorder's `text_digest` per row


@dataclass(frozen=True)
class TemplateUse:
    """What an edit asks of the template cache (set at preparation; plain data)."""

    key: str  # template id + the geometry activations depend on
    tokens: torch.Tensor  # [tokens] bool, raster order: the image tokens its mask repaints
    text: tuple[bytes, ...] = ()  # per row, a digest of its conditioning (`text_digest`): equal text replays
    register: bool = False  # records the template afresh, whatever the store holds (POST /v1/templates)


def template_key(template_id: str, content: str, height: int, width: int, steps: int, rows: int,
                 loras: tuple[tuple[str, float, str], ...] = ()) -> str:
    """Everything a template's activations depend on: its image (`content`, its pixels' digest:
    a template id reused for another picture names another template, recorded anew), geometry,
    and adapters (name, scale and file digest each)."""
    adapters = "".join(f":{name}@{scale:g}#{digest}" for name, scale, digest in sorted(loras))
    return f"{template_id}:{content}:{height}x{width}:{steps}:{rows}{adapters}"


def text_digest(cond: dict[str, torch.Tensor], rows: int) -> tuple[bytes, ...]:
    """Per forward row, a digest of everything it is conditioned on (prompt embeddings, pooled
    embeddings, guidance): rows of equal digests have equal text rows in every block, but for
    what they attend to."""
    digests = []
    for row in range(rows):
        digest = hashlib.blake2b(digest_size=16)
        for name in sorted(cond):
            value = cond[name]
            part = value[row] if value.ndim and value.shape[0] == rows else value
            digest.update(name.encode())
            digest.update(part.detach().float().cpu().numpy().tobytes())
        digests.append(digest.digest())
    return tuple(digests)


def content_id(image: np.ndarray) -> str:
    """A template id of an image's pixels (the same picture in any encoding gives the same id)."""
    digest = hashlib.blake2b(image.tobytes(), digest_size=16)
    digest.update(repr(image.shape).encode())
    return digest.hexdigest()


@dataclass
class _Image:
    """One image (request row) of a forward, as the pass treats it."""

    tokens: int
    computed: torch.Tensor | None = None  # local token indices it computes; None: all
    entry: dict[str, torch.Tensor] | None = None  # the template's activations at this step (replay)
    full_blocks: frozenset[str] = frozenset()  # blocks where the load plan computes all its tokens
    row: int = 0  # its row of its request (CFG: 0 uncond, 1 cond)
    text_replay: bool = False  # its text rows are the template's too: its text is the recorder's (DiTs)
    record: dict[str, list[torch.Tensor | None]] | None = None  # its request's recording of this step


@dataclass
class TemplateCounts:
    replayed_tokens: int = 0  # token-blocks whose output came from a template (a token in one block)
    computed_tokens: int = 0  # token-blocks computed, in blocks that replayed some
    replayed_text: int = 0  # text-row-blocks whose output came from a template (DiTs)
    full_steps: int = 0  # edit steps of a known template that ran in full (near-full mask, store miss)

    def snapshot(self, store: TemplateStore) -> dict[str, int]:
        """Counters of this cache and its store, to report the change over a step."""
        return {"replayed": self.replayed_tokens, "computed": self.computed_tokens, "replayed_text": self.replayed_text,
                "miss": store.misses, **store.hits}


class TemplateCache:
    """One device's templates: the store, who records which key, and the counters."""

    def __init__(self, config: TemplateConfig, device: torch.device | str = "cpu", model: str = ""):
        """`model`: the digest of the model's weights (`model_digest`), which a directory an
        earlier run left must have been recorded with for its templates to be reused."""
        self.config = config
        self.device = torch.device(device)
        self._scratch = None if config.directory else tempfile.TemporaryDirectory(prefix="gouache-templates-")
        self.store = TemplateStore(config.directory or self._scratch.name, config.budgets(), device, owner=model)
        self.cost = None
        if config.cost_model:  # imported here: scikit-learn takes a second to import, in every worker
            from gouache.sched.costmodel import load_mask_model

            self.cost = load_mask_model(config.cost_model)
        self.counts = TemplateCounts()
        self._reported = self.counts.snapshot(self.store)  # the counters at the last report
        self._lock = threading.Lock()
        self._recording: dict[str, str] = {}  # key -> the request recording it
        self._roles: dict[str, tuple[str, str]] = {}  # request id -> (role, key), decided at its first step here

    def take_report(self) -> TemplateReport:
        """What template replay did since the last report (once per step that used it), and what
        the store holds."""
        now = self.counts.snapshot(self.store)
        change = {name: n - self._reported.get(name, 0) for name, n in now.items()}
        self._reported = now
        tokens = {name: change.pop(name) for name in ("replayed", "computed", "replayed_text")}
        return TemplateReport(tokens, change, self.store.held())

    def role(self, request_id: str, use: TemplateUse, step: int, steps: int) -> str:
        """Record, replay, or neither (an edit whose key another request records right now and
        has no step 0 yet, or one that arrives here mid-way: it runs in full). A replay starts
        reading every step it will need from the disk tier, in order, in the store's thread."""
        with self._lock:
            role = self._roles.get(request_id, (None, ""))[0]
            if role is None:
                if use.register and step == 0:
                    role = "record"
                    self._recording[use.key] = request_id
                elif self.store.tier_of(f"{use.key}/0") is not None:
                    role = "replay"
                    for later in range(step, steps):
                        self.store.prefetch(f"{use.key}/{later}")
                elif step == 0 and use.key not in self._recording:
                    role = "record"
                    self._recording[use.key] = request_id
                else:
                    role = "full"
                self._roles[request_id] = (role, use.key)
            return role

    def release(self, request_id: str) -> None:
        with self._lock:
            role, key = self._roles.pop(request_id, (None, ""))
            for recorded in [k for k, rid in self._recording.items() if rid == request_id]:
                del self._recording[recorded]
            if role == "replay" and not any(k == key for r, k in self._roles.values() if r == "replay"):
                self.store.drop_reads(f"{key}/")  # what it read ahead from disk and nobody will take

    def begin(self, model: nn.Module, states: Sequence, tokens: Sequence[int],
              blocks: Sequence[str]) -> ReplayForward | None:
        """The forward's template roles, None when no state uses a template this step;
        `tokens[i]`: image tokens of states[i]; `blocks`: the keys of the blocks that replay."""
        images, recordings, any_template = [], [], False
        for state, count in zip(states, tokens):
            use = state.template
            parts = [_Image(count, row=row) for row in range(state.rows)]
            images.extend(parts)
            if use is None:
                continue
            rid = state.request.request_id
            role = self.role(rid, use, state.step, len(state.timesteps))
            if role == "record":
                any_template = True
                recordings.append(_record(state, parts))
            elif role == "replay":
                tier = self.store.tier_of(f"{use.key}/{state.step}")
                entry = self.store.get(f"{use.key}/{state.step}")
                if entry is None:  # evicted, unreadable, or its recorder stopped early: record it again
                    self.counts.full_steps += 1
                    any_template = True
                    recordings.append(_record(state, parts))
                    continue
                computed = use.tokens | entry[MASK].to(use.tokens.device, torch.bool)
                full_blocks = self.plan(blocks, count, float(computed.float().mean()), state.rows, tier)
                if full_blocks is None:
                    self.counts.full_steps += 1
                    continue
                any_template = True
                local = computed.nonzero().squeeze(1)
                recorded = [bytes(row.tolist()) for row in entry[TEXT]] if TEXT in entry else []
                same_rows = len(recorded) == len(use.text)
                for part in parts:
                    part.entry, part.computed, part.full_blocks = entry, local, full_blocks
                    part.text_replay = same_rows and recorded[part.row] == use.text[part.row]
        return ReplayForward(self, model, tuple(blocks), images, recordings) if any_template else None

    def plan(self, blocks: Sequence[str], tokens: int, share: float, rows: int,
             tier: str | None) -> frozenset[str] | None:
        """The blocks an edit computing `share` of its `tokens` runs in full, by InstGenIE's load
        plan (`plan_loads`) on the profiled costs (`--template-cost-model`); None: the whole step
        in full, where the plan is no faster than regenerating. Loads cost nothing where the
        entry already sits in the device's memory (its device tier, or any memory on a CPU).
        Without a profile: in full above `full_above` of the tokens, else nothing in full."""
        if self.cost is None:
            return None if share > self.config.full_above else frozenset()
        batch, n = [(tokens, share)] * rows, len(blocks)
        transfers = self.device.type != "cpu" and tier != "device"
        load = self.cost.load_time(batch) / n if transfers else 0.0
        plan = plan_loads([self.cost.compute_time(batch) / n] * n,
                          [self.cost.compute_time([(tokens, 1.0)] * rows) / n] * n, [load] * n)
        plain = self.cost.plain_time(batch)
        if not any(plan.use_cache) or (plain is not None and plan.latency_s >= plain):
            return None
        return frozenset(key for key, use in zip(blocks, plan.use_cache) if not use)

    def finish(self, recordings: list, blocks: list[str]) -> None:
        """Store what a forward recorded (one entry per recorder and step), if it ran every block."""
        for name, record, use, rows, last, rid in recordings:
            if not all(len(record.get(block, ())) == rows for block in blocks):
                continue  # the forward failed part-way: nothing of it is stored
            entry = {label: torch.stack(parts) for label, parts in record.items()}
            entry[MASK] = use.tokens.to(torch.uint8).cpu()
            if use.text:
                entry[TEXT] = torch.tensor([list(d) for d in use.text], dtype=torch.uint8)
            self.store.put(name, entry)
            if last:
                with self._lock:
                    if self._recording.get(use.key) == rid:
                        del self._recording[use.key]


def _record(state, parts: list[_Image]) -> tuple:
    """A recording of `state`'s activations at its step, filled by the forward's pass."""
    use, record = state.template, {}
    for part in parts:
        part.record = record
    return (f"{use.key}/{state.step}", record, use, state.rows, state.step + 1 == len(state.timesteps),
            state.request.request_id)


@dataclass
class ReplayForward:
    """The images of one forward as the template cache sees them, in the caller's row order."""

    cache: TemplateCache
    model: nn.Module
    blocks: tuple[str, ...]  # keys of the blocks that replay, in forward order
    images: list[_Image]
    recordings: list = field(default_factory=list)

    def begin(self, units: Sequence[int] | None = None, order: Sequence[int] | None = None,
              mode: str = "token", text_len: int = 0) -> TemplatePass:
        if mode != "token" or units is None:
            raise ValueError("template reuse runs on a packed forward's tokens")
        return TemplatePass(self, [self.images[i] for i in order], text_len)


class TemplatePass:
    """One forward's template reuse, with the block cache's pass interface (`gouache.block_cache.blocks`):
    image tokens (`select`, `merge`, `kv`) and, in a packed DiT, each image's `text_len` text
    rows (`select_text`, `merge_text`, `text_kv`)."""

    caches_kv = True  # attentions take the template's keys and values (`kv`)

    def __init__(self, replay: ReplayForward, images: list[_Image], text_len: int = 0):
        self.replay, self.images, self.text_len = replay, images, text_len  # images in packed order
        self.skeletons: dict[str, object] = {}
        self.names = {id(m): name for name, m in attention_modules(replay.model)}
        self.num_units = sum(image.tokens for image in images)
        self._index: dict[tuple, tuple] = {}
        self._block = ""  # the block running now

    def _replays(self, block: str) -> tuple[bool, ...]:
        return tuple(image.computed is not None and block not in image.full_blocks for image in self.images)

    def _indices(self, device: torch.device, block: str, text: bool = False):
        """At `block`: (computed rows or None: all, replayed rows, (image, its local replayed
        rows) per image replayed there), of image tokens or of text rows."""
        replays = self._replays(block)
        key = (device, replays, text)
        if key not in self._index:
            computed, replayed, sources, start = [], [], [], 0
            for image, replay in zip(self.images, replays):
                size = self.text_len if text else image.tokens
                every = torch.arange(size, device=device)
                local = None
                if replay and not text:
                    local = image.computed.to(device)
                elif replay and image.text_replay:
                    local = every[:0]
                if local is None:
                    computed.append(start + every)
                else:
                    keep = torch.ones(size, dtype=torch.bool, device=device)
                    keep[local] = False
                    computed.append(start + local)
                    replayed.append(start + every[keep])
                    sources.append((image, every[keep]))
                start += size
            rows = torch.cat(computed)
            everything = not replayed and (text or not any(r and i.text_replay for r, i in zip(replays, self.images)))
            self._index[key] = (None if everything else rows, torch.cat(replayed) if replayed else rows[:0], sources)
        return self._index[key]

    def varies(self) -> str | None:
        """Why blocks compute different rows in this forward (an edit records every token; the
        load plan runs some blocks in full); None where every block computes the same (`rows`)."""
        if self.replay.recordings:
            return "template recording"
        if any(image.full_blocks for image in self.images):
            return "template load plan"
        return None

    def rows(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Where every block computes the same rows (`varies`): the image tokens and the text
        rows (None: all) each computes."""
        self._block = self.replay.blocks[0]
        image = self._indices(device, self._block)[0]
        return (torch.arange(self.num_units, device=device) if image is None else image,
                self._indices(device, self._block, text=True)[0])

    def count(self, computed: torch.Tensor, text: torch.Tensor | None, blocks: int, text_blocks: int) -> None:
        """Count a forward that computed `computed` tokens (and `text` rows) in `blocks` blocks,
        `text_blocks` of which output text rows, as `merge` and `merge_text` count each."""
        counts = self.replay.cache.counts
        counts.replayed_tokens += (self.num_units - len(computed)) * blocks
        counts.computed_tokens += len(computed) * blocks
        if text is not None:
            counts.replayed_text += (self.text_len * len(self.images) - len(text)) * text_blocks

    def template(self, name: str, like: torch.Tensor, text: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows the running block replays (image tokens or text rows) and the templates'
        `name` activations of them, as `like`'s dtype and device."""
        _, replayed, sources = self._indices(like.device, self._block, text)
        rows = [image.entry[name][image.row].to(like.device, like.dtype).index_select(0, local)
                for image, local in sources]
        return replayed, torch.cat(rows) if rows else like[:0]

    def select(self, block: str, x: torch.Tensor) -> torch.Tensor | None:
        if x.shape[0] != self.num_units:
            raise ValueError(f"block input has {x.shape[0]} rows for {self.num_units} image tokens")
        self._block = block  # the attentions inside it fill their keys and values by its indices
        return self._indices(x.device, block)[0]

    def select_text(self, block: str, text: torch.Tensor) -> torch.Tensor | None:
        if text.shape[0] != self.text_len * len(self.images):
            raise ValueError(f"block has {text.shape[0]} text rows for {len(self.images)} images of {self.text_len}")
        return self._indices(text.device, block, text=True)[0]

    def merge(self, block: str, x: torch.Tensor, computed: torch.Tensor | None,
              fresh: Sequence[torch.Tensor | None] | None) -> list[torch.Tensor | None]:
        if computed is not None:
            counts = self.replay.cache.counts
            counts.replayed_tokens += self.num_units - len(computed)
            counts.computed_tokens += len(computed)
        return [self._fill(block, f, computed) for f in fresh]

    def merge_text(self, block: str, fresh: torch.Tensor, computed: torch.Tensor | None) -> torch.Tensor:
        if computed is not None:
            self.replay.cache.counts.replayed_text += self.text_len * len(self.images) - len(computed)
        return self._fill(f"{block}.text", fresh, computed, text=True)

    def kv(self, attn: nn.Module, k: torch.Tensor, v: torch.Tensor,
           computed: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        name = self.names[id(attn)]
        return self._fill(f"{name}.k", k, computed), self._fill(f"{name}.v", v, computed)

    def text_kv(self, attn: nn.Module, k: torch.Tensor, v: torch.Tensor,
                computed: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        name = self.names[id(attn)]
        return (self._fill(f"{name}.text_k", k, computed, text=True),
                self._fill(f"{name}.text_v", v, computed, text=True))

    def _fill(self, name: str, x: torch.Tensor, computed: torch.Tensor | None, text: bool = False) -> torch.Tensor:
        """x (rows of `computed`, or all) for every image token (text row): the replayed ones'
        from their templates; records the recorders' rows."""
        full = x
        if computed is not None:
            full = x.new_empty((self.text_len * len(self.images) if text else self.num_units, *x.shape[1:]))
            full.index_copy_(0, computed, x)
            replayed, rows = self.template(name, x, text)
            if len(replayed):
                full.index_copy_(0, replayed, rows)
        start = 0
        for image in self.images:
            size = self.text_len if text else image.tokens
            if image.record is not None:
                image.record.setdefault(name, []).append(full[start:start + size].detach().clone())
            start += size
        return full

    def end(self) -> None:
        self.replay.cache.finish(self.replay.recordings, self.replay.blocks)
