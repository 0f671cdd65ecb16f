# mixplane: one image for `mixplane operator` and every component (`mixplane planner|loader|constructor`).
# Build: docker build -t mixplane:0.1.0 .   (multi-stage: the build tools stay in the first stage)
# No torch: it is the trainer client's extra (mixplane[torch]); operator and components do without it.

ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
RUN python -m venv /opt/mixplane \
 && /opt/mixplane/bin/pip install --no-cache-dir pip==25.3 setuptools==80.9.0 wheel==0.45.1
COPY pyproject.toml README.md ./
COPY src ./src
RUN /opt/mixplane/bin/pip install --no-cache-dir --no-build-isolation ".[k8s]" \
 && /opt/mixplane/bin/mixplane --help > /dev/null

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="mixplane" \
      org.opencontainers.image.description="Kubernetes-native multisource data plane for foundation-model training" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 mixplane \
 && useradd --system --uid 10001 --gid mixplane --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin mixplane
COPY --from=build /opt/mixplane /opt/mixplane
ENV PATH=/opt/mixplane/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /tmp
USER 10001:10001
ENTRYPOINT ["mixplane"]
CMD ["operator"]
