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
            "/predictions/{model_name}/{model_version}/v1/health"} <= paths


def test_dockerfile_passes_hadolint():
    run = subprocess.run([str(BIN / "hadolint"), "--failure-threshold", "warning", str(REPO / "Dockerfile")],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    text = (REPO / "Dockerfile").read_text()
    assert "FROM python:3.11-slim" in text and "\nUSER " in text


def manifests():
    return sorted((REPO / "deploy").glob("*.yaml"))


@pytest.mark.parametrize("path", [p for p in manifests() if "kserve" not in p.name], ids=lambda p: p.name)
def test_kubernetes_manifests_match_their_schemas(path):
    import kubernetes_validate

    for doc in yaml.safe_load_all(path.read_text()):
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
}
KSERVE_SCALE_METRICS = {"cpu", "memory", "concurrency", "rps"}


def test_kserve_inference_service():
    import kubernetes_validate

    isvc = yaml.safe_load((REPO / "deploy" / "kserve-inferenceservice.yaml").read_text())
    assert isvc["apiVersion"] == "serving.kserve.io/v1beta1" and isvc["kind"] == "InferenceService"
    assert set(isvc) == {"apiVersion", "kind", "metadata", "spec"} and set(isvc["spec"]) <= {"predictor", "transformer", "explainer"}
    predictor = isvc["spec"]["predictor"]
    assert set(predictor) <= KSERVE_PREDICTOR_FIELDS, set(predictor) - KSERVE_PREDICTOR_FIELDS
    assert predictor["scaleMetric"] in KSERVE_SCALE_METRICS and predictor["minReplicas"] <= predictor["maxReplicas"]
    # The predictor's containers as a Pod: the Kubernetes schema checks every container field.
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "isvc-check"},
           "spec": {"containers": predictor["containers"]}}
    kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
