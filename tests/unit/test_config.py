import pytest

from app.cli import parse_config
from app.config import ConfigError, load_config


def test_defaults_come_from_the_toml_file():
    cfg = load_config()
    assert cfg.model == "qwen/Qwen1.5-0.5B-Chat"
    assert (cfg.host, cfg.port) == ("127.0.0.1", 7860)
    assert cfg.sampling.max_new_tokens == 512


def test_flags_override_the_file(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('workers = 3\nport = 9000\n[sampling]\ntemperature = 0.2\n')
    cfg = parse_config(["--config", str(path), "--port", "9100", "--threads-per-worker", "1"])
    assert (cfg.workers, cfg.port, cfg.threads_per_worker) == (3, 9100, 1)
    assert cfg.sampling.temperature == 0.2
    defaults = load_config()  # the file changed only what it lists; the rest is configs/default.toml's
    assert (cfg.model, cfg.max_batch, cfg.sampling.top_p) == (defaults.model, defaults.max_batch, defaults.sampling.top_p)


def test_unknown_key_is_named(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("wokers = 2\n")
    with pytest.raises(ConfigError, match="unknown key.*wokers"):
        load_config(path)


@pytest.mark.parametrize("text, message", [
    ("workers = 0", "workers must be a positive integer"),
    ("port = 70000", "port must be 1-65535"),
    ("dtype = 'fp8'", "dtype must be"),
    ("workers = [", "not valid TOML"),
    ("quantize = 'int4'\nengine = 'lean'", "quantize int4 runs on the onnxruntime graph"),
])
def test_bad_values_are_refused_clearly(tmp_path, text, message):
    path = tmp_path / "c.toml"
    path.write_text(text + "\n")
    with pytest.raises(ConfigError, match=message):
        load_config(path)


def test_launch_reports_a_bad_config_and_exits_2(tmp_path, capsys):
    from app.cli import main

    path = tmp_path / "c.toml"
    path.write_text("port = 0\n")
    assert main(["--config", str(path)]) == 2
    assert "port must be" in capsys.readouterr().err


def test_hosting_environment_sets_host_and_port_and_flags_win():
    env = {"PORT": "7000", "GRADIO_SERVER_NAME": "0.0.0.0"}
    cfg = parse_config([], environ=env)
    assert (cfg.host, cfg.port) == ("0.0.0.0", 7000)
    assert parse_config(["--port", "7001"], environ=env).port == 7001
    with pytest.raises(ConfigError, match="PORT must be a number"):
        parse_config([], environ={"PORT": "http"})


def test_local_workers_by_default_and_ray_from_the_file_or_the_flags(tmp_path):
    assert (load_config().backend, load_config().ray_address) == ("local", "auto")
    path = tmp_path / "c.toml"
    path.write_text('backend = "ray"\n')
    assert parse_config(["--config", str(path)]).backend == "ray"
    cfg = parse_config(["--backend", "ray", "--ray-address", "ray://head:10001"])
    assert (cfg.backend, cfg.ray_address) == ("ray", "ray://head:10001")
    with pytest.raises(ConfigError, match="backend must be one of local, ray"):
        load_config(overrides={"backend": "dask"})
