"""The shipped Ray configs: Ray Serve's own schema accepts them, they build selftune's application,
and the KubeRay example serves the same application as configs/ray/serve.yaml."""

from __future__ import annotations

import pytest
import yaml

from ray.serve.schema import ServeDeploySchema

from autotune import shipped


def ray_file(name: str):
    return yaml.safe_load((shipped.root() / "ray" / name).read_text())


def test_serve_config_is_valid_for_ray_and_builds_the_application():
    from ray.serve import Application

    from autotune.cluster.app import app_builder

    schema = ServeDeploySchema.model_validate(ray_file("serve.yaml"))
    (app,) = schema.applications
    assert app.import_path == "autotune.cluster.app:app_builder"
    built = app_builder(app.args)
    assert isinstance(built, Application)


def test_rayservice_example_serves_the_same_application():
    service = ray_file("rayservice.yaml")
    assert service["kind"] == "RayService"
    embedded = ServeDeploySchema.model_validate(yaml.safe_load(service["spec"]["serveConfigV2"]))
    assert embedded == ServeDeploySchema.model_validate(ray_file("serve.yaml"))
    head_env = {e["name"]: e["value"] for e in service["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]}
    assert head_env["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"] == "autotune.cluster.proxy_retry:middlewares"


def test_a_bad_override_in_the_serve_config_names_the_key():
    from autotune.cluster.app import app_builder
    from autotune.settings import ConfigError

    with pytest.raises(ConfigError, match="cluster.max_replicas"):
        app_builder({"config": "builtin:default", "cluster.max_replicas": 0})
