"""Renders deploy/k8s kustomizations into a list of Kubernetes objects.

Uses `kubectl kustomize` when kubectl is installed; otherwise a small
renderer of the kustomize features deploy/k8s uses (resources, components
and their own resources, JSON6902 patches with add/replace/remove, image
tags, configMapGenerator names, labels on the base's own objects), so CI
machines without kubectl still check the manifests.
test_deploy_manifests.py compares the two where kubectl exists.

    objects = render("/src/deploy/k8s/overlays/lws")
    workload = find(objects, "LeaderWorkerSet", "tally")
"""

import copy
import os
import shutil
import subprocess

import yaml


def render(directory, use_kubectl=None):
    """Objects of the kustomization in `directory`. use_kubectl None: when
    kubectl is on PATH."""
    if use_kubectl is None:
        use_kubectl = shutil.which("kubectl") is not None
    if use_kubectl:
        out = subprocess.run(["kubectl", "kustomize", directory], check=True,
                             capture_output=True, text=True).stdout
        return [o for o in yaml.safe_load_all(out) if o]
    return _render_lite(directory)


def find(objects, kind, name):
    matches = [o for o in objects
               if o["kind"] == kind and o["metadata"]["name"] == name]
    if len(matches) != 1:
        raise KeyError(f"{len(matches)} objects of kind {kind} named {name}")
    return matches[0]


def _load(path):
    with open(path, encoding="utf-8") as f:
        return [o for o in yaml.safe_load_all(f) if o]


def _resources(kustomization, directory):
    """The objects of the `resources` of `kustomization` (in `directory`)."""
    objects = []
    for resource in kustomization.get("resources", []):
        path = os.path.join(directory, resource)
        objects.extend(_render_lite(path) if os.path.isdir(path)
                       else _load(path))
    return objects


def _render_lite(directory):
    kustomization = _load(os.path.join(directory, "kustomization.yaml"))[0]
    objects = _resources(kustomization, directory)
    for generator in kustomization.get("configMapGenerator", []):
        objects.append({"apiVersion": "v1", "kind": "ConfigMap",
                        "metadata": {"name": generator["name"]}})
    for label_set in kustomization.get("labels", []):
        for obj in objects:
            obj["metadata"].setdefault("labels", {}).update(label_set["pairs"])
    for component in kustomization.get("components", []):
        component_dir = os.path.join(directory, component)
        component_kustomization = _load(os.path.join(component_dir,
                                                     "kustomization.yaml"))[0]
        # A component's resources join the overlay's objects, and its
        # transformers apply to all of them.
        objects.extend(_resources(component_kustomization, component_dir))
        _apply_transformers(component_kustomization, component_dir, objects)
    _apply_transformers(kustomization, directory, objects)
    return objects


def _apply_transformers(kustomization, directory, objects):
    _apply_patches(kustomization, directory, objects)
    for image in kustomization.get("images", []):
        for container in _containers(objects):
            name, _, _ = container["image"].partition(":")
            if name == image["name"]:
                container["image"] = f"{image.get('newName', name)}:{image['newTag']}"


def _containers(node):
    """Every container and init container anywhere under `node`."""
    if isinstance(node, list):
        for item in node:
            yield from _containers(item)
    elif isinstance(node, dict):
        for key, value in node.items():
            if key in ("containers", "initContainers"):
                yield from value
            else:
                yield from _containers(value)


def _apply_patches(kustomization, directory, objects):
    for patch in kustomization.get("patches", []):
        if "patch" in patch:
            operations = yaml.safe_load(patch["patch"])
        else:
            operations = _load(os.path.join(directory, patch["path"]))[0]
        target = patch["target"]
        for obj in objects:
            if (obj["kind"] == target["kind"]
                    and obj["metadata"]["name"] == target.get(
                        "name", obj["metadata"]["name"])):
                for operation in operations:
                    _apply_operation(obj, operation)


def _apply_operation(obj, operation):
    """One JSON6902 operation (add, replace or remove) on `obj`, in place."""
    keys = [k.replace("~1", "/").replace("~0", "~")
            for k in operation["path"].split("/")[1:]]
    parent = obj
    for key in keys[:-1]:
        parent = parent[int(key)] if isinstance(parent, list) else parent[key]
    last = keys[-1]
    if operation["op"] == "remove":
        del parent[int(last) if isinstance(parent, list) else last]
        return
    value = copy.deepcopy(operation["value"])
    if operation["op"] == "add" and isinstance(parent, list):
        if last == "-":
            parent.append(value)
        else:
            parent.insert(int(last), value)
    elif operation["op"] in ("add", "replace"):
        if isinstance(parent, list):
            parent[int(last)] = value
        else:
            if operation["op"] == "replace" and last not in parent:
                raise KeyError(f"replace of missing {operation['path']}")
            parent[last] = value
    else:
        raise ValueError(f"unsupported patch op {operation['op']}")
