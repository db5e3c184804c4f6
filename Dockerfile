# redroll engine worker / consumer images, each on the official image of its engine's pinned release.
#
#   docker build .                             the SGLang image (the default: the last stage, `sglang`)
#   docker build --target sglang -t redroll:latest .
#   docker build --target vllm -t redroll:vllm .   the vLLM image (CUDA, the official vllm wheel)
#
# SGLANG_VERSION is the pin of pyproject.toml's `sglang` extra and of
# engine_worker/engines/sglang_contract.py (tests/test_sglang_contract.py checks that all three agree).
# VLLM_VERSION is GPU_WHEEL of engine_worker/engines/vllm_contract.py (tests/test_vllm_image.py
# checks that the two agree).
ARG SGLANG_VERSION=0.5.23
ARG BASE_IMAGE=lmsysorg/sglang:v${SGLANG_VERSION}
ARG VLLM_VERSION=0.34.0
ARG VLLM_BASE_IMAGE=vllm/vllm-openai:v${VLLM_VERSION}

# ------------------------------------------------------------------- source (what both images install)
FROM scratch AS source
WORKDIR /src
COPY pyproject.toml README.md MANIFEST.in ./
COPY scripts/build_backend.py ./scripts/
COPY shared ./shared
COPY producer ./producer
COPY engine_worker ./engine_worker
COPY consumer ./consumer
COPY redroll ./redroll

# ---------------------------------------------------------------------------------------------- vllm
FROM ${VLLM_BASE_IMAGE} AS vllm
ARG VLLM_VERSION
WORKDIR /opt/redroll
COPY --from=source /src ./
# Exactly the pinned vllm (a no-op on the official image of that release), then redroll; the build
# fails when any other vllm ends up installed (a local suffix such as +cu129 is ignored).
RUN python3 -m pip install --no-cache-dir "vllm==${VLLM_VERSION}" ".[metrics]" \
 && python3 -c "import vllm, sys; v = vllm.__version__; sys.exit(0 if v.split('+')[0] == '${VLLM_VERSION}' else f'vllm {v} is installed; this image needs ${VLLM_VERSION}')"
# The official image starts `vllm serve`; this one runs whatever command it is given.
ENTRYPOINT []
CMD ["redroll", "--help"]

# -------------------------------------------------------------------------- sglang (the default image)
FROM ${BASE_IMAGE} AS sglang
ARG SGLANG_VERSION
WORKDIR /opt/redroll
COPY --from=source /src ./
# Exactly the tested sglang (a no-op when the base image has it), then redroll; the build fails
# when any other sglang ends up installed.
RUN pip install --no-cache-dir "sglang==${SGLANG_VERSION}" ".[metrics]" \
 && python -c "import sglang, sys; v = sglang.__version__; sys.exit(0 if v == '${SGLANG_VERSION}' else f'sglang {v} is installed; this image needs ${SGLANG_VERSION}')"
ENTRYPOINT []
CMD ["redroll", "--help"]
