"""RunnerConfig validation: bad configs fail before anything launches, with the field and value named."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from scaling.runner import DockerConfig, HostSpec, RunnerConfig, SlurmConfig


def pdsh(**kw):
    return RunnerConfig(runner_type="pdsh", script="/opt/app/train.py", **kw)


def test_hosts_parse_with_default_and_explicit_slots():
    cfg = pdsh(hosts=["node-01 slots=8", "node-02", "10.0.0.7 slots=2"], nproc_per_node=4)
    assert cfg.host_specs() == [HostSpec("node-01", 8), HostSpec("node-02", 4), HostSpec("10.0.0.7", 2)]


def test_hostsfile_mpi_style(tmp_path):
    f = tmp_path / "hostfile"
    f.write_text("# cluster\nnode-01 slots=2\n\nnode-02 slots=4  # big one\n")
    assert pdsh(hostsfile=str(f)).host_specs() == [HostSpec("node-01", 2), HostSpec("node-02", 4)]


def test_hosts_and_hostsfile_both_set(tmp_path):
    with pytest.raises(ValidationError, match=r"hosts=\['a'\] and hostsfile=.* are both set; give one"):
        pdsh(hosts=["a"], hostsfile=str(tmp_path / "h"))


def test_duplicate_host():
    with pytest.raises(ValidationError, match=r"duplicate host 'node-01'"):
        pdsh(hosts=["node-01 slots=2", "node-02", "node-01"])


def test_duplicate_host_in_hostsfile(tmp_path):
    f = tmp_path / "hostfile"
    f.write_text("a slots=1\na slots=2\n")
    with pytest.raises(ValidationError, match=r"hostsfile .* duplicate host 'a'"):
        pdsh(hostsfile=str(f))


@pytest.mark.parametrize("slots", ["0", "-2"])
def test_slots_must_be_positive(slots):
    with pytest.raises(ValidationError, match=rf"hosts\[1\]: host 'b' has slots={slots}; slots must be > 0"):
        pdsh(hosts=["a", f"b slots={slots}"])


def test_slots_not_an_integer_and_unknown_option():
    with pytest.raises(ValidationError, match=r"slots='x' of host 'a' is not an integer"):
        pdsh(hosts=["a slots=x"])
    with pytest.raises(ValidationError, match=r"cannot parse 'gpus=2' in host entry"):
        pdsh(hosts=["a gpus=2"])


def test_missing_script_is_refused_at_launch_not_at_definition():
    # A default written into an app's config class (runner: RunnerConfig = Field(RunnerConfig())).
    from pydantic import Field

    from scaling.config import BaseConfig
    from scaling.runner import runner_main

    class AppConfig(BaseConfig):
        runner: RunnerConfig = Field(RunnerConfig(), description="how to launch")

    config = AppConfig()
    assert config.runner.script is None
    with pytest.raises(ValueError, match=r"script is missing \(got None\); set runner.script"):
        runner_main(config.runner, dry_run=True)
    with pytest.raises(ValidationError, match=r"script='  ' is empty"):
        RunnerConfig(runner_type="pdsh", hosts=["a"], script="  ")


def test_local_script_must_exist(tmp_path):
    with pytest.raises(ValidationError, match=r"script='.*nope.py' does not exist on this machine"):
        RunnerConfig(script=str(tmp_path / "nope.py"))


def test_script_that_looks_like_an_option():
    with pytest.raises(ValidationError, match=r"script='--help' starts with '-'"):
        RunnerConfig(runner_type="pdsh", script="--help", hosts=["a"])


def test_missing_hostsfile(tmp_path):
    with pytest.raises(ValidationError, match=r"hostsfile='.*missing' does not exist"):
        pdsh(hostsfile=str(tmp_path / "missing"))


def test_local_rejects_hosts(worker_script):
    with pytest.raises(ValidationError, match=r"runner_type='local' does not take hosts/hostsfile"):
        RunnerConfig(script=worker_script, hosts=["a"])


def test_pdsh_docker_needs_docker_config():
    with pytest.raises(ValidationError, match=r"runner_type='pdsh_docker' needs docker_config"):
        RunnerConfig(runner_type="pdsh_docker", script="train.py")


@pytest.mark.parametrize(
    "host",
    ["a;touch SENTINEL", "-oProxyCommand=x", "a b", "$(id)", "`id`", "a|b", "a&&b", "h\nx", "a'b", "a>b", ""],
)
def test_hosts_with_shell_characters_or_options_are_rejected(host):
    with pytest.raises(ValidationError, match=r"(is not allowed; use letters|empty host entry|cannot parse)"):
        pdsh(hosts=[host])


@pytest.mark.parametrize("addr", ["-oProxyCommand=x", "a;b", "$(id)"])
def test_master_addr_is_checked(addr):
    with pytest.raises(ValidationError, match=r"master_addr: host name .* is not allowed"):
        pdsh(hosts=["a"], master_addr=addr)


def test_env_names_and_secret_values_in_config():
    with pytest.raises(ValidationError, match=r"env: 'BAD-NAME' is not an environment variable name"):
        pdsh(hosts=["a"], env={"BAD-NAME": "1"})
    with pytest.raises(ValidationError, match=r"env: 'HF_TOKEN' looks like a secret"):
        pdsh(hosts=["a"], env={"HF_TOKEN": "x"})
    with pytest.raises(ValidationError, match=r"env_forward: 'A;B' is not a variable name"):
        pdsh(hosts=["a"], env_forward=["A;B"])


def test_docker_mount_paths():
    DockerConfig(image="img", mounts=[("/data/with space;semi", "/data")])  # inert in an argv: allowed
    with pytest.raises(ValidationError, match=r"mounts\[0\] host path 'rel/path' must be absolute"):
        DockerConfig(image="img", mounts=[("rel/path", "/data")])
    with pytest.raises(
        ValidationError, match=r"mounts\[1\] container path '/a:/b' must be absolute and contain no ':'"
    ):
        DockerConfig(image="img", mounts=[("/x", "/y"), ("/x", "/a:/b")])
    with pytest.raises(ValidationError, match=r"docker image '--privileged' must not start with '-'"):
        DockerConfig(image="--privileged")
    with pytest.raises(ValidationError, match=r"docker command 'podman --root=/x' must not start with '-' or contain"):
        DockerConfig(image="img", command="podman --root=/x")
    assert DockerConfig(image="img", command="/usr/bin/podman").command == "/usr/bin/podman"


def test_slurm_fields_cannot_break_the_script():
    with pytest.raises(ValidationError, match=r"must be non-empty, one word"):
        SlurmConfig(partition="gpu\n#SBATCH --exclusive")
    with pytest.raises(ValidationError, match=r"extra_args item 'x' must be one '--option=value'"):
        SlurmConfig(extra_args=["x"])
    with pytest.raises(ValidationError, match=r"runner_type='slurm' does not take hosts"):
        RunnerConfig(runner_type="slurm", script="t.py", hosts=["a"])


def test_unknown_field_and_bad_port():
    with pytest.raises(ValidationError, match=r"nodes\n  Extra inputs are not permitted"):
        RunnerConfig(runner_type="pdsh", script="t.py", nodes=2)
    with pytest.raises(ValidationError, match=r"master_port\n  Input should be less than or equal to 65535"):
        pdsh(hosts=["a"], master_port=70000)


def test_launched_config_defaults_the_script_to_the_apps(tmp_path):
    from scaling.runner import LaunchedConfig

    class AppConfig(LaunchedConfig):
        default_script = tmp_path / "train.py"

    (tmp_path / "train.py").write_text("")
    (tmp_path / "mine.py").write_text("")
    assert AppConfig.from_dict({}).runner.script == str(tmp_path / "train.py")
    assert AppConfig.from_dict({"runner": {"nproc_per_node": 2}}).runner.nproc_per_node == 2
    assert AppConfig.from_dict({"runner": {"script": str(tmp_path / "mine.py")}}).runner.script == str(
        tmp_path / "mine.py"
    )
