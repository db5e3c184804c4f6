# redroll engine worker / consumer image, on the SGLang image of the one tested release.
# SGLANG_VERSION is the pin of pyproject.toml's `sglang` extra and of
# engine_worker/engines/sglang_contract.py (tests/test_sglang_contract.py checks that all three agree).
ARG SGLANG_VERSION=0.5.23
ARG BASE_IMAGE=lmsysorg/sglang:v${SGLANG_VERSION}
FROM ${BASE_IMAGE}
ARG SGLANG_VERSION
WORKDIR /opt/redroll
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY producer ./producer
COPY engine_worker ./engine_worker
COPY consumer ./consumer
COPY redroll ./redroll
# Exactly the tested sglang (a no-op when the base image has it), then redroll; the build fails
# when any other sglang ends up installed.
RUN pip install --no-cache-dir "sglang==${SGLANG_VERSION}" ".[metrics]" \
 && python -c "import sglang, sys; v = sglang.__version__; sys.exit(0 if v == '${SGLANG_VERSION}' else f'sglang {v} is installed; this image needs ${SGLANG_VERSION}')"
ENTRYPOINT []
CMD ["redroll", "--help"]
