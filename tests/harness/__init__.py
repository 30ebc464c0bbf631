"""Test harness: real control plane, Prometheus and a local kubelet stand-in.

Modules: tools (binary paths), controlplane (etcd + kube-* + kwok on loopback),
cluster (the handle the `cluster` fixture yields), kubelet (runs a pod's workload as
a local process and reports its exit), local_pods (kubelet for every pod of kwok's CPU nodes;
hack/run-pods-local.py), prometheus (a Prometheus on loopback), docs (the ```yaml blocks of a docs page).
"""
