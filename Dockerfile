# The one image for the operator, the gateway and the Ray head/worker pods.
# CPU torch by default; for GPUs build with --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu124
# and EXTRAS=gpu (flashinfer, triton).
FROM python:3.11-slim
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG EXTRAS=""
# uid 65532 as the chart's runAsUser
RUN useradd --uid 65532 --create-home --shell /usr/sbin/nologin specd
WORKDIR /opt/specd
# gcc: the CPU attention kernel is compiled on first use (kernels/specd/kernels/cpu_attention.py)
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
COPY pyproject.toml README.md ./
COPY workers workers
COPY kernels kernels
COPY operator operator
RUN pip install --no-cache-dir --index-url "$TORCH_INDEX" "torch==2.13.0" \
 && pip install --no-cache-dir ".${EXTRAS:+[$EXTRAS]}"
# the shipped demo pair, so examples/demo.yaml-style deployments run in a cluster
COPY examples /opt/specd/examples
USER 65532
ENV HOME=/home/specd
ENTRYPOINT []
CMD ["specd", "--help"]
