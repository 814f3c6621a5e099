"""A JSON Schema of ``inference.networking.k8s.io/v1`` ``InferencePool`` objects, written
for these tests from the published CRD: Gateway API Inference Extension **v1.6.0**,
``config/crd/bases/inference.networking.k8s.io_inferencepools.yaml`` (bundle-version
v1.6.0, tag commit 992e5c292afb248801ce8d9234eb5b9d28eea231). Every constraint of the
CRD's ``openAPIV3Schema`` for ``spec`` is here (types, required fields, enums, patterns,
lengths, ranges, list sizes, ``additionalProperties: false`` as the API server's pruning
would drop unknown fields), and its two CEL rules written as JSON Schema: target port
numbers are unique, and ``endpointPickerRef.port`` is required when ``kind`` is
``Service`` (the default).

The published file itself is not kept in the repository (fetched third-party files are not
committed here); to check against it too, point ``LORAMUX_INFERENCEPOOL_CRD`` at a copy
(``tests/helm/test_inferencepool.py`` then validates with its ``openAPIV3Schema`` as well).
"""

from __future__ import annotations

SOURCE = ("https://github.com/kubernetes-sigs/gateway-api-inference-extension/blob/v1.6.0/"
          "config/crd/bases/inference.networking.k8s.io_inferencepools.yaml")
VERSION = "v1.6.0"

_PORT = {
    "type": "object",
    "additionalProperties": False,
    "required": ["number"],
    "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 65535}},
}
_LABEL_VALUE = {"type": "string", "minLength": 0, "maxLength": 63,
                "pattern": r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"}

SPEC = {
    "type": "object",
    "additionalProperties": False,
    "required": ["selector", "targetPorts"],
    "properties": {
        "appProtocol": {"type": "string", "enum": ["http", "kubernetes.io/h2c"]},
        "endpointPickerRef": {
            "type": "object",
            "additionalProperties": False,
            "required": ["name"],
            "properties": {
                "failureMode": {"type": "string", "enum": ["FailOpen", "FailClose"]},
                "group": {"type": "string", "minLength": 0, "maxLength": 253,
                          "pattern": r"^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?"
                                     r"(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"},
                "kind": {"type": "string", "minLength": 1, "maxLength": 63,
                         "pattern": r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$"},
                "name": {"type": "string", "minLength": 1, "maxLength": 253},
                "port": _PORT,
            },
            # CEL: self.kind != 'Service' || has(self.port); kind defaults to Service
            "if": {"anyOf": [{"not": {"required": ["kind"]}},
                             {"properties": {"kind": {"const": "Service"}}}]},
            "then": {"required": ["port"]},
        },
        "selector": {
            "type": "object",
            "additionalProperties": False,
            "required": ["matchLabels"],
            "properties": {"matchLabels": {"type": "object", "minProperties": 1,
                                           "maxProperties": 64,
                                           "additionalProperties": _LABEL_VALUE}},
        },
        "targetPorts": {
            "type": "array", "minItems": 1, "maxItems": 8, "items": _PORT,
            "uniqueItems": True,  # CEL: port number must be unique
        },
    },
}

SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "inference.networking.k8s.io/v1"},
        "kind": {"const": "InferencePool"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": SPEC,
    },
}
