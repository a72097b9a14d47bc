"""Fault drills for issue 32's items on files users own, the ControlNet service, templates and
patch sizes, each against real `gouache serve` processes, repeated `--runs` times:

- `lora-rewrite` (item 1): a LoRA file rewritten in place (`open("wb")`, chunked writes, as `cp`
  does) over and over while requests name it, in process and under `--executor multiproc
  --devices 2`; `controlnet-rewrite`: the same for a ControlNet's weights. Passes when the
  server lives, every request is answered 200 or 4xx (never 5xx, never no answer).
- `lora-during-template` (item 2): `--template-cache --lora-dir` on the shapes UNet; generations
  each naming an adapter not loaded yet, sent while template edits replay. Passes when all are 200.
- `controlnet-async-death` (item 4): `--controlnet-workers 2 --controlnet-mode async`; the
  service worker of one ControlNet is killed while requests of both run. Passes when every
  request of the other ControlNet is 200 and the victim's are answered.
- `template-dir-restart` (item 5): template edits of more pictures than `--template-dir`'s disk
  budget holds, a restart, edits of the newest two again; then `--replicas 2`. Passes when each
  store's directory stays within its budget, the restarted server replays from the files the
  first one left, and each replica has its own subdirectory.
- `controlnet-replaced` (item 6): a ControlNet's weights replaced atomically (its config.json
  and timestamps as they were). Passes when `POST /v1/controlnets` says loaded, the image changes,
  and putting the old weights back gives the old image again.
- `template-other-image` (item 8): a template registered from one picture, then an edit of
  another picture naming it. Passes when that edit equals the exact edit of its own picture.
- `patched-sizes` (item 9): `--policy patched` on the shapes UNet, 71 requests of every size it
  takes. Passes when all are 200.

    .venv/bin/python benchmarks/faults/adapters_templates.py --runs 10 [--only lora-rewrite,...]
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import random
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

from gouache.bench.server_process import descendants, server_process

MODEL = "shapes-unet"
CAPTION = "a red circle at the top left and a blue square at the bottom right on a white background"
TIMEOUT_S = 120.0  # a request unanswered this long counts as no answer


# -- clients ---------------------------------------------------------------------------------


def png(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, "PNG")
    return buffer.getvalue()


def noise(size: int, seed: int, channels: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (size, size, channels), dtype=np.uint8)


def generate(base: str, **fields) -> tuple[int | None, dict]:
    body = {"prompt": CAPTION, "size": "64x64", "num_inference_steps": 4, "seed": 1, **fields}
    try:
        response = httpx.post(f"{base}/v1/images/generations", json=body, timeout=TIMEOUT_S)
        return response.status_code, response.json()
    except (httpx.HTTPError, ValueError) as error:
        return None, {"error": type(error).__name__}


def edit(base: str, image: np.ndarray, mask: np.ndarray | None, path: str = "/v1/images/edits",
         **fields) -> tuple[int | None, dict]:
    files = {"image": ("i.png", png(image), "image/png")}
    if mask is not None:
        files["mask"] = ("m.png", png(mask), "image/png")
    data = {"prompt": CAPTION, "num_inference_steps": "4", "seed": "1", **{k: str(v) for k, v in fields.items()}}
    try:
        response = httpx.post(f"{base}{path}", data=data, files=files, timeout=TIMEOUT_S)
        return response.status_code, response.json()
    except (httpx.HTTPError, ValueError) as error:
        return None, {"error": type(error).__name__}


def pixels(answer: dict) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(answer["data"][0]["b64_json"])))).astype(int)


def corner_mask(size: int = 64) -> np.ndarray:
    mask = np.full((size, size, 4), 255, np.uint8)
    mask[: size // 2, : size // 2, 3] = 0  # transparent: repaint the top left quarter
    return mask


def statuses(answers: list[tuple[int | None, dict]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for status, _ in answers:
        out[str(status)] = out.get(str(status), 0) + 1
    return out


# -- files -----------------------------------------------------------------------------------


class Adapters:
    """Random LoRAs and ControlNets of the model (built once per drill)."""

    def __init__(self):
        from gouache.models.zoo import load_pipeline

        self.pipe = load_pipeline(MODEL)

    def lora(self, seed: int) -> bytes:
        from safetensors.torch import save

        from gouache.lora.files import random_lora

        return save(random_lora(self.pipe, rank=8, seed=seed))

    def controlnet(self, directory: Path, seed: int) -> Path:
        from gouache.controlnet.model import random_controlnet

        random_controlnet(self.pipe, seed=seed, std=0.2).save_pretrained(str(directory))
        return directory


def rewrite_in_place(path: Path, versions: list[bytes], stop: threading.Event, pause_s: float = 0.01) -> int:
    """Rewrite `path` as `cp` does, alternating `versions`, `pause_s` apart, until `stop`; how many times."""
    count = 0
    while not stop.is_set():
        data = versions[count % 2]
        with open(path, "wb") as handle:
            for start in range(0, len(data), 1 << 14):
                handle.write(data[start:start + (1 << 14)])
                handle.flush()
                time.sleep(0.0005)
        count += 1
        time.sleep(pause_s)
    return count


def serving(args: list[str], work: Path, name: str):
    return server_process(["--model", MODEL, *args], work / f"{name}.log")


# -- the drills ------------------------------------------------------------------------------


def under_rewrites(serve: list[str], work: Path, name: str, path: Path, versions: list[bytes], pause_s: float,
                   fields: dict) -> dict:
    """40 generations with `fields` while `path` is rewritten in place; passes when the server
    lives and answers each 200 or 400 (some 200)."""
    with serving(serve, work, name) as (proc, base):
        stop = threading.Event()
        with ThreadPoolExecutor(9) as pool:
            writer = pool.submit(rewrite_in_place, path, versions, stop, pause_s)
            answers = list(pool.map(lambda i: generate(base, seed=i, **fields), range(40)))
            stop.set()
            rewrites = writer.result()
        alive = proc.poll() is None and httpx.get(f"{base}/health", timeout=10).status_code == 200
    seen = statuses(answers)
    ok = alive and set(seen) <= {"200", "400"} and seen.get("200", 0) > 0
    return {"passed": ok, "alive": alive, "statuses": seen, "rewrites": rewrites}


def lora_rewrite(adapters: Adapters, work: Path, executor: str = "uniproc") -> dict:
    loras = work / "loras"
    loras.mkdir()
    versions = [adapters.lora(1), adapters.lora(2)]
    (loras / "x.safetensors").write_bytes(versions[0])
    extra = ["--executor", "multiproc", "--devices", "2", "--policy", "fixed-sp-1"] if executor == "multiproc" else []
    return under_rewrites(["--lora-dir", str(loras), *extra], work, f"lora-{executor}", loras / "x.safetensors",
                          versions, 0.01, {"loras": [{"name": "x"}]})


def controlnet_rewrite(adapters: Adapters, work: Path) -> dict:
    nets = work / "controlnets"
    adapters.controlnet(nets / "c", 1)
    weights = nets / "c" / "diffusion_pytorch_model.safetensors"
    versions = [weights.read_bytes(), (adapters.controlnet(work / "other", 2) / weights.name).read_bytes()]
    control = base64.b64encode(png(noise(64, 3))).decode()
    # a ControlNet's weights take a while to write: pauses between rewrites let some reads find them whole
    return under_rewrites(["--controlnet-dir", str(nets)], work, "controlnet-rewrite", weights, versions, 0.5,
                          {"controlnets": [{"name": "c", "image": control}]})


def lora_during_template(adapters: Adapters, work: Path) -> dict:
    loras = work / "loras"
    loras.mkdir()
    for i in range(12):
        (loras / f"fresh{i}.safetensors").write_bytes(adapters.lora(10 + i))
    picture, mask = noise(64, 5), corner_mask()
    with serving(["--template-cache", "--lora-dir", str(loras)], work, "lora-during-template") as (proc, base):
        edit(base, picture, mask, template_id="t", num_inference_steps=20)  # recorded: later edits replay it
        with ThreadPoolExecutor(6) as pool:
            edits = [pool.submit(edit, base, picture, mask, template_id="t", num_inference_steps=20, seed=s)
                     for s in range(6)]
            time.sleep(0.3)
            gens = list(pool.map(lambda i: generate(base, loras=[{"name": f"fresh{i}"}]), range(12)))
            edited = [f.result() for f in edits]
    ok = statuses(gens) == {"200": 12} and statuses(edited) == {"200": 6}
    return {"passed": ok, "generations": statuses(gens), "edits": statuses(edited),
            "errors": [a.get("error", {}).get("message") for s, a in gens if s != 200][:3]}


def _service_worker_pid(server: int, index: int) -> int | None:
    for pid in descendants(server):
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == f"gouache-cn-{index}":
                return pid
        except OSError:
            continue
    return None


def controlnet_async_death(adapters: Adapters, work: Path) -> dict:
    from gouache.config import ServiceAddress

    nets = work / "controlnets"
    names = [f"n{i}" for i in range(8)]
    address = ServiceAddress(("a", "b"), b"")
    victim = next(n for n in names if address.worker_of(n) == 0)
    healthy = next(n for n in names if address.worker_of(n) == 1)
    for seed, name in enumerate((victim, healthy)):
        adapters.controlnet(nets / name, seed)
    control = base64.b64encode(png(noise(64, 3))).decode()
    serve = ["--controlnet-dir", str(nets), "--controlnet-workers", "2", "--controlnet-mode", "async",
             "--max-batch-size", "8"]
    with serving(serve, work, "controlnet-async-death") as (proc, base):
        pid = _service_worker_pid(proc.pid, 0)
        with ThreadPoolExecutor(8) as pool:
            futures = {name: [pool.submit(generate, base, seed=s, num_inference_steps=40,
                                          controlnets=[{"name": name, "image": control}]) for s in range(4)]
                       for name in (victim, healthy)}
            time.sleep(1.5)  # both are denoising
            os.kill(pid, 9)
            answers = {name: [f.result() for f in fs] for name, fs in futures.items()}
    ok = statuses(answers[healthy]) == {"200": 4} and "None" not in statuses(answers[victim])
    return {"passed": ok, "victim": statuses(answers[victim]), "healthy": statuses(answers[healthy])}


def _dir_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.glob("*.safetensors"))


def _disk_lookups(base: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    line = next((line for line in text.splitlines()
                 if line.startswith('gouache_template_store_lookups_total{') and 'result="disk"' in line), None)
    return float(line.rsplit(" ", 1)[1]) if line else 0.0


def template_dir_restart(adapters: Adapters, work: Path) -> dict:
    store, budget_mb = work / "templates", 2
    serve = ["--template-dir", str(store), "--template-disk-mb", str(budget_mb), "--template-mb", "1"]
    pictures, mask = [noise(64, 20 + i) for i in range(6)], corner_mask()  # more than the budget holds
    sizes = []
    for run, indices in enumerate((range(6), (5, 4))):  # then the newest two again: their files are left
        with serving(serve, work, f"templates-{run}") as (proc, base):
            answers = [edit(base, pictures[i], mask, template_id=f"p{i}") for i in indices]
            replayed = _disk_lookups(base)
            proc.terminate()
            proc.wait(60)
        sizes.append(_dir_bytes(store))
    with serving([*serve, "--replicas", "2"], work, "templates-replicas") as (proc, base):
        replica_answers = [edit(base, p, mask, template_id=f"p{i}") for i, p in enumerate(pictures)]
        proc.terminate()
        proc.wait(60)
    per_replica = {d.name: _dir_bytes(d) for d in sorted(store.iterdir()) if d.is_dir()}
    budget = budget_mb << 20
    ok = (statuses(answers) == {"200": 2} and statuses(replica_answers) == {"200": 6} and replayed > 0
          and all(0 < size <= budget for size in sizes)
          and set(per_replica) == {"replica-0", "replica-1"} and all(v <= budget for v in per_replica.values()))
    return {"passed": ok, "dir_bytes_after_each_run": sizes, "budget": budget, "disk_lookups_after_restart": replayed,
            "replica_dir_bytes": per_replica}


def controlnet_replaced(adapters: Adapters, work: Path) -> dict:
    nets = work / "controlnets"
    adapters.controlnet(nets / "c", 1)
    weights = nets / "c" / "diffusion_pytorch_model.safetensors"
    old, new = weights.read_bytes(), (adapters.controlnet(work / "other", 2) / weights.name).read_bytes()
    stamp = os.stat(weights)
    control = base64.b64encode(png(noise(64, 3))).decode()

    def put(data: bytes) -> None:
        (nets / "c" / "next").write_bytes(data)
        os.replace(nets / "c" / "next", weights)
        os.utime(weights, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))

    with serving(["--controlnet-dir", str(nets)], work, "controlnet-replaced") as (proc, base):
        body = {"controlnets": [{"name": "c", "image": control}]}
        first = generate(base, **body)
        put(new)
        registered = httpx.post(f"{base}/v1/controlnets", json={"name": "c"}, timeout=60).json()
        second = generate(base, **body)
        put(old)
        third = generate(base, **body)
    ok = (all(s == 200 for s, _ in (first, second, third)) and registered.get("loaded")
          and np.abs(pixels(first[1]) - pixels(second[1])).max() > 0
          and np.array_equal(pixels(first[1]), pixels(third[1])))
    return {"passed": bool(ok), "changed": bool(np.abs(pixels(first[1]) - pixels(second[1])).max() > 0),
            "restored": bool(np.array_equal(pixels(first[1]), pixels(third[1])))}


def template_other_image(adapters: Adapters, work: Path) -> dict:
    white, other, mask = np.full((64, 64, 3), 255, np.uint8), noise(64, 6), corner_mask()
    with serving([], work, "template-other-image") as (proc, base):
        registered = edit(base, white, None, path="/v1/templates", template_id="t")
        reused = edit(base, other, mask, template_id="t")
        exact = edit(base, other, mask, template_cache="false")
    difference = int(np.abs(pixels(reused[1]) - pixels(exact[1])).max()) if reused[0] == exact[0] == 200 else None
    ok = registered[0] == 200 and difference is not None and difference <= 1
    return {"passed": ok, "max_difference": difference}


def patched_sizes(adapters: Adapters, work: Path) -> dict:
    sides = (64, 96, 128)
    rng = random.Random(0)
    sizes = [f"{rng.choice(sides)}x{rng.choice(sides)}" for _ in range(71)]
    with serving(["--policy", "patched"], work, "patched-sizes") as (proc, base):
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda s: generate(base, size=s, num_inference_steps=3), sizes))
    return {"passed": statuses(answers) == {"200": 71}, "statuses": statuses(answers)}


DRILLS = {
    "lora-rewrite": lora_rewrite,
    "lora-rewrite-multiproc": lambda adapters, work: lora_rewrite(adapters, work, "multiproc"),
    "controlnet-rewrite": controlnet_rewrite,
    "lora-during-template": lora_during_template,
    "controlnet-async-death": controlnet_async_death,
    "template-dir-restart": template_dir_restart,
    "controlnet-replaced": controlnet_replaced,
    "template-other-image": template_other_image,
    "patched-sizes": patched_sizes,
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--only", default=",".join(DRILLS), help="comma-separated drills (default: all)")
    p.add_argument("--out", default="benchmarks/results/faults/adapters_templates.json")
    args = p.parse_args()
    names = args.only.split(",")
    adapters = Adapters()
    results: dict[str, list[dict]] = {name: [] for name in names}
    for run in range(args.runs):
        for name in names:
            with tempfile.TemporaryDirectory(prefix=f"gouache-drill-{name}-") as work:
                start = time.perf_counter()
                try:
                    result = DRILLS[name](adapters, Path(work))
                except Exception as error:  # the drill itself failed: a failed run, with why
                    result = {"passed": False, "error": f"{type(error).__name__}: {error}"}
                result["seconds"] = round(time.perf_counter() - start, 1)
            results[name].append(result)
            print(f"run {run + 1} {name}: {'pass' if result['passed'] else 'FAIL'} {json.dumps(result)}", flush=True)
    print("\n| drill | passed |\n|---|---|")
    for name, runs in results.items():
        print(f"| {name} | {sum(r['passed'] for r in runs)} of {len(runs)} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": "benchmarks/faults/adapters_templates.py", "runs": args.runs,
                               "results": results}, indent=2))
    return 0 if all(r["passed"] for runs in results.values() for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
