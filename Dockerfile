# The store daemon and conductor image (helm/kvtier deploys it). No torch: neither needs it
# (tests/test_image.py runs both with torch made unimportable). Engines embed the client library
# in their own image, with torch.
#
#   docker build -t kvtier:0.1.0 .                      # DRAM + NVMe tiers, TCP data plane
#   docker build --build-arg EXTRAS=ucx -t kvtier:0.1.0-ucx .
#
# The GPU (HBM) tier needs a CUDA base image plus torch and cupy (`EXTRAS=gpu,torch`).
FROM python:3.11-slim-bookworm
ARG EXTRAS=""
WORKDIR /opt/kvtier
COPY pyproject.toml README.md ./
COPY kvstore ./kvstore
COPY conductor ./conductor
COPY bench ./bench
RUN pip install --no-cache-dir ".${EXTRAS:+[$EXTRAS]}" && kvtier version
ENTRYPOINT []
CMD ["kvtier", "--help"]
