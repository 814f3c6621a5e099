"""The chart's ``router.mode: inferencepool``: rendered with ``helm template``; every
manifest validated (Kubernetes schemas by kubernetes-validate, strict; the InferencePool
against its CRD's schema, ``inferencepool_v1_schema.py``); and the wiring the picker needs:
the pool selects the engine pods, points at the picker's Service, the picker scrapes the
engines' protocol metrics port, engines are labelled ``llm-d.ai/engine-type: vllm``, run
the all-in-one role with the listener, are ready only once the model is loaded, and the
NetworkPolicy opens the listener to the picker only."""

from __future__ import annotations

import json
import os
from pathlib import Path

import jsonschema
import pytest
import yaml
from inferencepool_v1_schema import SCHEMA
from test_chart import (  # noqa: F401
    CHART,
    K8S_VERSION,
    PRODUCTION,
    by_kind,
    helm,
    one,
    render,
    run_helm,
)

POOL = ("router.mode=inferencepool",)
PRECISE = (*POOL, "router.epp.prefixCache=precise", "router.epp.tokenizer.url=http://tok:8000",
           "router.epp.tokenizer.modelName=Qwen/Qwen2.5-1.5B-Instruct",
           "engine.servedModelName=qwen")
CRD_KINDS = {("inference.networking.k8s.io/v1", "InferencePool"),
             ("monitoring.coreos.com/v1", "ServiceMonitor")}


def validate_pool(doc: dict) -> None:
    jsonschema.validate(doc, SCHEMA)
    published = os.environ.get("LORAMUX_INFERENCEPOOL_CRD")
    if published:  # the CRD file as published, when a copy is at hand
        crd = yaml.safe_load(Path(published).read_text())
        (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
        jsonschema.validate(doc, v1["schema"]["openAPIV3Schema"])


@pytest.mark.parametrize("values,sets", [((), POOL), ((), PRECISE), ((PRODUCTION,), POOL)],
                         ids=["approximate", "precise", "production"])
def test_every_manifest_is_valid(helm, values, sets):  # noqa: F811
    import kubernetes_validate

    docs = render(helm, *values, sets=sets)
    assert not by_kind(docs, "HorizontalPodAutoscaler")  # no loramux gateways to scale
    for doc in docs:
        key = (doc["apiVersion"], doc["kind"])
        if key == ("inference.networking.k8s.io/v1", "InferencePool"):
            validate_pool(doc)
        elif key not in CRD_KINDS:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    args = ["lint", "--strict", str(CHART), *(a for v in values for a in ("-f", str(v)))]
    for s in sets:
        args += ["--set", s]
    assert "0 chart(s) failed" in run_helm(helm, *args).stdout


def test_the_schema_refuses_broken_pools(helm):  # noqa: F811
    """The schema is not a no-op: each broken pool below is refused."""
    pool = one(render(helm, sets=POOL), "InferencePool", "lmx-loramux")
    validate_pool(pool)
    breakages = [
        lambda s: s.update(targetPorts=[]),
        lambda s: s.update(targetPorts=[{"number": 8000}, {"number": 8000}]),
        lambda s: s.update(targetPorts=[{"number": 70000}]),
        lambda s: s["endpointPickerRef"].pop("port"),
        lambda s: s["endpointPickerRef"].update(failureMode="Sometimes"),
        lambda s: s["selector"].update(matchLabels={}),
        lambda s: s.update(selector={"matchExpressions": []}),
        lambda s: s.update(extra=1),
    ]
    for breakage in breakages:
        broken = json.loads(json.dumps(pool))
        breakage(broken["spec"])
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(broken, SCHEMA)


def test_pool_picker_and_engines_fit_together(helm):  # noqa: F811
    docs = render(helm, sets=POOL)
    pool = one(docs, "InferencePool", "lmx-loramux")["spec"]
    engine = one(docs, "StatefulSet", "lmx-loramux-engine")
    pod = engine["spec"]["template"]
    assert pool["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert pod["metadata"]["labels"]["llm-d.ai/engine-type"] == "vllm"
    c = pod["spec"]["containers"][0]
    assert pool["targetPorts"] == [{"number": c["ports"][0]["containerPort"]}]
    # the engine authenticates tenant keys itself and serves the protocol metrics
    assert c["args"][:3] == ["serve", "--role", "all"]
    metrics_port = int(c["args"][c["args"].index("--protocol-metrics-port") + 1])
    assert {"name": "protocol-metrics", "containerPort": metrics_port, "protocol": "TCP"} in c["ports"]
    assert "--kv-events-endpoint" not in c["args"]  # approximate prefix: no events needed
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"  # 503 until the model is loaded
    # the picker: its Service is the pool's endpointPickerRef
    ref = pool["endpointPickerRef"]
    svc = one(docs, "Service", ref["name"])
    assert ref["kind"] == "Service" and ref["port"]["number"] in [p["port"] for p in svc["spec"]["ports"]]
    epp = one(docs, "Deployment", "lmx-loramux-epp")
    assert svc["spec"]["selector"].items() <= epp["spec"]["template"]["metadata"]["labels"].items()
    ec = epp["spec"]["template"]["spec"]["containers"][0]
    assert ec["image"] == "ghcr.io/llm-d/llm-d-router-endpoint-picker:v0.10.0"
    assert ec["args"][ec["args"].index("--pool-name") + 1] == "lmx-loramux"
    assert ec["args"][ec["args"].index("--pool-group") + 1] == "inference.networking.k8s.io"
    # its config: scrape the listener port; queue, KV, LoRA-affinity and prefix scorers
    cfg = yaml.safe_load(one(docs, "ConfigMap", "lmx-loramux-epp")["data"]["epp-config.yaml"])
    assert cfg["kind"] == "EndpointPickerConfig"
    plugins = {p["type"]: p.get("parameters", {}) for p in cfg["plugins"]}
    assert plugins["metrics-data-source"]["port"] == metrics_port
    profile = {p["pluginRef"]: p.get("weight") for p in cfg["schedulingProfiles"][0]["plugins"]}
    for scorer in ("queue-scorer", "kv-cache-utilization-scorer", "lora-affinity-scorer",
                   "prefix-cache-scorer"):
        assert scorer in plugins and profile[scorer] > 0
    role = one(docs, "Role", "lmx-loramux-epp")
    assert {"pods"} <= {r for rule in role["rules"] for r in rule["resources"]}
    assert "inferencepools" in {r for rule in role["rules"] for r in rule["resources"]}
    # no loramux gateways in this mode
    assert not [d for d in docs if d["metadata"]["name"] == "lmx-loramux-gateway"]


def test_network_policy_opens_the_listener_to_the_picker_only(helm):  # noqa: F811
    docs = render(helm, sets=PRECISE)
    (policy,) = by_kind(docs, "NetworkPolicy")
    engine = one(docs, "StatefulSet", "lmx-loramux-engine")["spec"]["template"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= engine["metadata"]["labels"].items()
    epp_labels = one(docs, "Deployment", "lmx-loramux-epp")["spec"]["template"]["metadata"]["labels"]
    rules = policy["spec"]["ingress"]
    http = [r for r in rules if {"port": 8000, "protocol": "TCP"} in r["ports"]]
    assert http and "from" not in http[0]  # the API: from anywhere by default
    (picker,) = [r for r in rules if {"port": 9400, "protocol": "TCP"} in r["ports"]]
    assert {p["port"] for p in picker["ports"]} == {9400, 5557}
    (peer,) = picker["from"]
    assert peer["podSelector"]["matchLabels"].items() <= epp_labels.items()
    assert peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "endpoint-picker"
    docs = render(helm, sets=(*POOL, "router.networkPolicy.enabled=false"))
    assert not by_kind(docs, "NetworkPolicy")


def test_precise_prefix_mode_wires_kv_events(helm):  # noqa: F811
    docs = render(helm, sets=PRECISE)
    c = one(docs, "StatefulSet", "lmx-loramux-engine")["spec"]["template"]["spec"]["containers"][0]
    assert c["args"][c["args"].index("--kv-events-endpoint") + 1] == "tcp://*:5557"
    assert c["args"][c["args"].index("--served-model-name") + 1] == "qwen"
    env = {e["name"]: e for e in c["env"]}
    assert env["LORAMUX_KV_EVENTS_TOPIC"]["value"] == "kv@$(POD_IP):8000@qwen"
    names = [e["name"] for e in c["env"]]
    assert names.index("POD_IP") < names.index("LORAMUX_KV_EVENTS_TOPIC")
    cfg = yaml.safe_load(one(docs, "ConfigMap", "lmx-loramux-epp")["data"]["epp-config.yaml"])
    plugins = {p["type"]: p.get("parameters", {}) for p in cfg["plugins"]}
    producer = plugins["precise-prefix-cache-producer"]
    assert producer["kvEventsConfig"]["podDiscoveryConfig"]["socketPort"] == 5557
    assert producer["tokenProcessorConfig"]["blockSize"] == 16
    assert plugins["prefix-cache-scorer"]["prefixMatchInfoProducerName"] == "precise-prefix-cache-producer"
    assert plugins["token-producer"]["vllm"]["url"] == "http://tok:8000"
    proc = run_helm(helm, "template", "lmx", str(CHART), "--set", "router.mode=inferencepool",
                    "--set", "router.epp.prefixCache=precise", check=False)
    assert proc.returncode != 0 and "router.epp.tokenizer" in proc.stderr


def test_runtime_lora_updating_is_off_unless_asked(helm):  # noqa: F811
    c = one(render(helm, sets=POOL), "StatefulSet", "lmx-loramux-engine")["spec"]["template"]["spec"]["containers"][0]
    assert "--allow-runtime-lora-updating" not in c["args"]
    docs = render(helm, sets=(*POOL, "router.allowRuntimeLoraUpdating=true"))
    c = one(docs, "StatefulSet", "lmx-loramux-engine")["spec"]["template"]["spec"]["containers"][0]
    assert "--allow-runtime-lora-updating" in c["args"]


def test_default_mode_renders_no_pool_and_a_bad_mode_fails(helm):  # noqa: F811
    docs = render(helm)
    assert not [d for d in docs if d["kind"] in ("InferencePool", "NetworkPolicy")]
    assert not [d for d in docs if "epp" in d["metadata"]["name"]]
    engine = one(docs, "StatefulSet", "lmx-loramux-engine")["spec"]["template"]
    assert "llm-d.ai/engine-type" not in engine["metadata"]["labels"]
    proc = run_helm(helm, "template", "lmx", str(CHART), "--set", "router.mode=envoy", check=False)
    assert proc.returncode != 0 and "router.mode must be loramux or inferencepool" in proc.stderr
