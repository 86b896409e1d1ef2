# ddtree-serve for compose.yaml. Two builds of one file:
#   docker build -t ddtree-serve:cuda .          # CUDA kernels for sm_90 (H100/H200), torch from the CUDA 12.8 index
#   docker build -t ddtree-serve:cpu --build-arg BASE_IMAGE=ubuntu:24.04 \
#       --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu --build-arg DDTREE_BUILD_CUDA=0 .
ARG BASE_IMAGE=nvidia/cuda:12.8.1-devel-ubuntu24.04
FROM ${BASE_IMAGE}
# Where torch comes from (the project accepts torch >= 2.4, < 2.15), and whether to build the CUDA
# kernels: a docker build sees no GPU, so the CUDA image asks for them (nvcc is in the devel image).
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
ARG DDTREE_BUILD_CUDA=1

ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH \
    TORCH_CUDA_ARCH_LIST=9.0 CMAKE_CUDA_ARCHITECTURES=90
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential git \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv $VIRTUAL_ENV

RUN pip install --upgrade pip \
 && pip install "torch>=2.4,<2.15" --index-url ${TORCH_INDEX} \
 && pip install "scikit-build-core>=0.10" "pybind11>=2.12" cmake ninja tiktoken tokenizers

WORKDIR /src
COPY pyproject.toml CMakeLists.txt README.md ./
COPY proto proto
COPY csrc csrc
COPY services services
COPY clients clients
COPY tools tools
RUN DDTREE_BUILD_CUDA=${DDTREE_BUILD_CUDA} pip install --no-build-isolation . && ddtree info

EXPOSE 50051 8000
CMD ["ddtree", "--help"]
