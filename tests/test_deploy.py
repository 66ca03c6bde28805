"""Static checks of what ships for operators: the OpenAPI spec, the Dockerfile, the Kubernetes and KServe manifests."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
K8S_VERSION = "1.33.0"


def test_openapi_spec_is_valid():
    from openapi_spec_validator import validate
    from openapi_spec_validator.readers import read_from_filename

    spec, _ = read_from_filename(str(REPO / "docs" / "openapi.yaml"))
    validate(spec)
    paths = set(spec["paths"])
    assert {"/predictions/{model_name}", "/predictions/{model_name}/{model_version}/v1/chat/completions",
            "/predictions/{model_name}/{model_version}/v1/completions", "/predictions/{model_name}/{model_version}/v1/models",
            "/predictions/{model_name}/{model_version}/v1/health", "/predictions/{model_name}/{model_version}/v1/responses",
            "/predictions/{model_name}/{model_version}/v1/responses/{response_id}",
            "/predictions/{model_name}/{model_version}/v1/messages",
            "/predictions/{model_name}/{model_version}/v1/messages/count_tokens"} <= paths


def test_dockerfile_passes_hadolint():
    run = subprocess.run([str(BIN / "hadolint"), "--failure-threshold", "warning", str(REPO / "Dockerfile")],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    text = (REPO / "Dockerfile").read_text()
    assert "FROM python:3.11-slim" in text and "\nUSER " in text


def manifests():
    return sorted((REPO / "deploy").glob("*.yaml"))


# Custom resources: no offline schema for them ships on PyPI; each has its own test below.
CRD_GROUPS = ("serving.kserve.io/", "keda.sh/")


def is_custom_resource(doc: dict) -> bool:
    return doc["apiVersion"].startswith(CRD_GROUPS)


@pytest.mark.parametrize("path", manifests(), ids=lambda p: p.name)
def test_kubernetes_manifests_match_their_schemas(path):
    import kubernetes_validate

    docs = list(yaml.safe_load_all(path.read_text()))
    for doc in docs:
        if not is_custom_resource(doc):
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_deployment_probes_use_the_health_paths():
    deployment = yaml.safe_load((REPO / "deploy" / "deployment.yaml").read_text())
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"].endswith("/v1/health")
    assert container["livenessProbe"]["httpGet"]["path"] == "/ping"
    hpa = yaml.safe_load((REPO / "deploy" / "hpa.yaml").read_text())
    from llm_api.service.metrics import METRICS

    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] in METRICS


# KServe's InferenceService is a CRD: no offline schema ships on PyPI (the kserve SDK has model
# classes, not the CRD). Its predictor embeds Kubernetes Container objects, which are checked against
# the Kubernetes schema; the KServe-level fields are checked against the v1beta1 field list below
# (from KServe's InferenceService CRD: spec.predictor is a PodSpec plus these component fields).
KSERVE_PREDICTOR_FIELDS = {
    "containers", "minReplicas", "maxReplicas", "scaleMetric", "scaleTarget", "containerConcurrency", "timeout",
    "canaryTrafficPercent", "serviceAccountName", "nodeSelector", "tolerations", "volumes", "model", "logger",
    "batcher", "labels", "annotations", "deploymentStrategy", "imagePullSecrets", "affinity", "securityContext",
    "terminationGracePeriodSeconds",
}
KSERVE_SCALE_METRICS = {"cpu", "memory", "concurrency", "rps"}


@pytest.mark.parametrize("name", ["kserve-inferenceservice.yaml", "kserve-standalone.yaml"])
def test_kserve_inference_service(name):
    import kubernetes_validate

    isvc = yaml.safe_load((REPO / "deploy" / name).read_text())
    assert isvc["apiVersion"] == "serving.kserve.io/v1beta1" and isvc["kind"] == "InferenceService"
    assert set(isvc) == {"apiVersion", "kind", "metadata", "spec"} and set(isvc["spec"]) <= {"predictor", "transformer", "explainer"}
    predictor = isvc["spec"]["predictor"]
    assert set(predictor) <= KSERVE_PREDICTOR_FIELDS, set(predictor) - KSERVE_PREDICTOR_FIELDS
    assert predictor["scaleMetric"] in KSERVE_SCALE_METRICS and predictor["minReplicas"] <= predictor["maxReplicas"]
    # The predictor's containers as a Pod: the Kubernetes schema checks every container field.
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "isvc-check"},
           "spec": {"containers": predictor["containers"],
                    **{k: v for k, v in predictor.items() if k == "terminationGracePeriodSeconds"}}}
    kubernetes_validate.validate(pod, K8S_VERSION, strict=True)


# ---------------------------------------------------------------------------------------------------
# llm_api serve (the standalone server)


def _standalone_container(doc: dict) -> dict:
    return doc["spec"]["template"]["spec"]["containers"][0]


def _public_probe(path: str) -> bool:
    """Whether `llm_api serve` answers GET ``path`` without a key (the route table decides it)."""
    from llm_api.protocols import table

    route, _ = table.find("GET", path, "server")
    return route.public and table.is_public(path)


def test_standalone_deployment_probes_drain_and_ports():
    deployment, service = yaml.safe_load_all((REPO / "deploy" / "standalone-deployment.yaml").read_text())
    container = _standalone_container(deployment)
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready" and _public_probe("/ready")
    assert container["livenessProbe"]["httpGet"]["path"] == "/health" and _public_probe("/health")
    assert container["command"][-1] == "serve" and "0.0.0.0" in container["args"]
    env = {e["name"]: e for e in container["env"]}
    assert "secretKeyRef" in env["LLM_API_KEY"]["valueFrom"]  # auth stays on: the probes need no key
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > float(env["DRAIN_GRACE_S"]["value"]) + float(pre_stop[1])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    args = container["args"]
    assert ports == {"http": int(args[args.index("--port") + 1]), "grpc": int(args[args.index("--grpc-port") + 1])}
    assert deployment["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == str(ports["http"])
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]


# KEDA's ScaledObject (keda.sh/v1alpha1) is a CRD with no schema on PyPI: its fields are checked against
# the ScaledObject specification (keda.sh/docs, reference/scaledobject-spec), its HPA behaviour against
# the Kubernetes HPA schema, and its query against the series the server exports.
KEDA_SPEC_FIELDS = {"scaleTargetRef", "pollingInterval", "cooldownPeriod", "initialCooldownPeriod", "idleReplicaCount",
                    "minReplicaCount", "maxReplicaCount", "fallback", "advanced", "triggers"}
KEDA_TRIGGER_FIELDS = {"type", "metadata", "name", "useCachedMetrics", "authenticationRef", "metricType"}
KEDA_PROMETHEUS_METADATA = {"serverAddress", "query", "threshold", "activationThreshold", "namespace",
                            "customHeaders", "ignoreNullValues", "unsafeSsl", "queryParameters"}


def test_keda_scaled_object_scales_the_standalone_deployment_on_its_queue():
    import kubernetes_validate

    scaled = yaml.safe_load((REPO / "deploy" / "standalone-keda.yaml").read_text())
    deployment, _ = yaml.safe_load_all((REPO / "deploy" / "standalone-deployment.yaml").read_text())
    assert scaled["apiVersion"] == "keda.sh/v1alpha1" and scaled["kind"] == "ScaledObject"
    spec = scaled["spec"]
    assert set(spec) <= KEDA_SPEC_FIELDS, set(spec) - KEDA_SPEC_FIELDS
    assert spec["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    hpa = {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": {"name": "keda-check"},
           "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "x"}, "maxReplicas": 8,
                    "behavior": spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]}}
    kubernetes_validate.validate(hpa, K8S_VERSION, strict=True)
    (trigger,) = spec["triggers"]
    assert set(trigger) <= KEDA_TRIGGER_FIELDS and trigger["type"] == "prometheus"
    metadata = trigger["metadata"]
    assert set(metadata) <= KEDA_PROMETHEUS_METADATA and float(metadata["threshold"]) > 0
    assert all(isinstance(v, str) for v in metadata.values())  # KEDA's metadata is a map of strings
    # The query reads a series llm_api serve exports (tests/test_standalone.py scrapes it).
    from llm_api.server.metrics import EngineCollector

    collector = EngineCollector("smollm2", lambda: None, lambda: 0)
    exported = {family.name for family in collector.collect()}
    assert "vllm:num_requests_waiting" in metadata["query"] and "vllm:num_requests_waiting" in exported
