# redroll engine worker / consumer image. The SGLang base image brings CUDA, torch and sglang 0.5.x.
ARG SGLANG_IMAGE=lmsysorg/sglang:v0.5.5-cu126
FROM ${SGLANG_IMAGE}
WORKDIR /opt/redroll
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY producer ./producer
COPY engine_worker ./engine_worker
COPY consumer ./consumer
COPY redroll ./redroll
RUN pip install --no-cache-dir ".[metrics]"
ENTRYPOINT []
CMD ["redroll", "--help"]
