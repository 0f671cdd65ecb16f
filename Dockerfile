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
# the dependencies in a layer of their own (from pyproject.toml alone): a change of src/ rebuilds in seconds
RUN mkdir -p src/mixplane && touch src/mixplane/__init__.py \
 && /opt/mixplane/bin/pip install --no-cache-dir --no-build-isolation ".[k8s]" \
 && /opt/mixplane/bin/pip uninstall -y -q mixplane && rm -rf src build ./*.egg-info
COPY src ./src
# then the package; then what no component runs (docs/deploy.md "Image"): the installers (pip, setuptools, wheel:
# the venv is read-only at run time), pyarrow's C++ headers, Cython sources and tests, and its Flight, Substrait,
# ORC and CUDA modules (mixplane reads Parquet through pyarrow.parquet / compute only) -- ~80 MB of 826
RUN /opt/mixplane/bin/pip install --no-cache-dir --no-build-isolation --no-deps ".[k8s]" \
 && /opt/mixplane/bin/mixplane --help > /dev/null \
 && pa=/opt/mixplane/lib/python3.11/site-packages/pyarrow \
 && rm -rf "$pa"/include "$pa"/tests "$pa"/*.pyx "$pa"/*.pxd "$pa"/*.pxi "$pa"/includes "$pa"/src \
      "$pa"/*flight* "$pa"/_substrait* "$pa"/substrait.py "$pa"/*_orc* "$pa"/orc.py "$pa"/*cuda* \
 && /opt/mixplane/bin/python -c "import pyarrow.parquet, pyarrow.compute, pyarrow.dataset, pyarrow.fs" \
 && /opt/mixplane/bin/python -m pip uninstall -y -q pip setuptools wheel \
 && rm -f /opt/mixplane/bin/activate* /opt/mixplane/bin/Activate.ps1

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
