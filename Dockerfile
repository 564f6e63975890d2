# The store daemon and conductor image (helm/kvtier deploys it). No torch: neither needs it
# (tests/test_image.py runs both with torch made unimportable). Engines embed the client library
# in their own image, with torch.
#
#   docker build -t kvtier:0.1.0 .                      # DRAM + NVMe tiers, TCP data plane
#   docker build --build-arg EXTRAS=ucx -t kvtier:0.1.0-ucx .
#
# The GPU (HBM) tier needs a CUDA base image plus torch and cupy (`EXTRAS=gpu,torch`).

# The optional native fast path (native/README.md), built where a compiler exists; the runtime
# image gets only the two shared objects (KVTIER_NATIVE_DIR tells kvstore.dataplane.native).
FROM python:3.11-slim-bookworm AS native
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY native ./native
RUN mkdir -p out \
    && gcc -O2 -Wall -shared -fPIC -o out/libkvtier_fastpath.so native/fastpath.c \
    && gcc -O2 -Wall -shared -fPIC \
         -I"$(python -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" \
         -o "out/kvtier_native$(python -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')" \
         native/pyfast.c

FROM python:3.11-slim-bookworm
ARG EXTRAS=""
WORKDIR /opt/kvtier
COPY --from=native /src/out /opt/kvtier/native
ENV KVTIER_NATIVE_DIR=/opt/kvtier/native
COPY pyproject.toml README.md ./
COPY kvstore ./kvstore
COPY conductor ./conductor
COPY planner ./planner
COPY bench ./bench
RUN pip install --no-cache-dir ".${EXTRAS:+[$EXTRAS]}" && kvtier version
ENTRYPOINT []
CMD ["kvtier", "--help"]
