# syntax=docker/dockerfile:1
# The toolproxy sidecar image: `docker build -t toolproxy:0.1.0 .`
#
# Two stages: `build` installs the runtime dependencies (pyproject.toml's
# [project].dependencies) into a virtualenv and byte-compiles the sources; the
# final stage is the same slim Python base with only that virtualenv and the
# sources copied in (plus Debian's nftables for the egress guard): no pip, no compilers, numeric
# non-root user. It runs with a read-only root filesystem (the chart sets it).
ARG PYTHON_IMAGE=python:3.12-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml ./
RUN python -m venv --without-pip /opt/toolproxy \
 && python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" > requirements.txt \
 && python -m pip --python /opt/toolproxy/bin/python install --only-binary=:all: -r requirements.txt
COPY proxy/ /app/proxy/
COPY toolproxy_verifier/ /app/toolproxy_verifier/
COPY schemas/ /app/schemas/
RUN /opt/toolproxy/bin/python -m compileall -q /app/proxy /app/toolproxy_verifier

FROM ${PYTHON_IMAGE} AS runtime
# The base image's own pip is not needed at run time. nft (Debian's nftables)
# is: the chart's egress guard init container runs `toolproxy egress-rules
# --apply` (proxy/guard/) from this image (docs/security.md); it is inert without NET_ADMIN.
RUN python -m pip uninstall -y -q pip \
 && apt-get update -qq && apt-get install -y -qq --no-install-recommends nftables \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/toolproxy /opt/toolproxy
COPY --from=build /app /app
ENV PATH=/opt/toolproxy/bin:$PATH \
    PYTHONPATH=/app \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
WORKDIR /app
USER 10001:10001
# 8787 agent API (loopback only), 8788 admin API, 9464 metrics and probes.
EXPOSE 8788 9464
ENTRYPOINT ["python", "-m", "proxy.cli"]
CMD ["run"]
