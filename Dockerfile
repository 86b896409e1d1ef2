# ddtree-serve with its CUDA kernels (sm_90, H100/H200), for compose.yaml.
#   docker build -t ddtree-serve .
FROM nvidia/cuda:12.8.1-devel-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH \
    TORCH_CUDA_ARCH_LIST=9.0 CMAKE_CUDA_ARCHITECTURES=90
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential git \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv $VIRTUAL_ENV

# torch first, from the CUDA 12.8 wheel index (the project accepts torch >= 2.4, < 2.15)
RUN pip install --upgrade pip \
 && pip install "torch>=2.4,<2.15" --index-url https://download.pytorch.org/whl/cu128 \
 && pip install "scikit-build-core>=0.10" "pybind11>=2.12" cmake ninja tiktoken tokenizers

WORKDIR /src
COPY pyproject.toml CMakeLists.txt README.md ./
COPY proto proto
COPY csrc csrc
COPY services services
COPY clients clients
COPY tools tools
# The CUDA kernels: a docker build sees no GPU, so DDTREE_BUILD_CUDA=1 asks for them (nvcc is in this devel image)
RUN DDTREE_BUILD_CUDA=1 pip install --no-build-isolation . && ddtree info

EXPOSE 50051 8000
CMD ["ddtree", "--help"]
