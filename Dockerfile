# One image for every rankscope service; compose.yaml picks the subcommand.
FROM python:3.11-slim
WORKDIR /app
# The dependencies first, read from pyproject.toml alone: a change of the code leaves
# this layer cached, and a rebuild installs rankscope itself only.
COPY pyproject.toml ./
RUN python -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies'], sep='\n')" \
    > /tmp/requirements.txt && pip install --no-cache-dir -r /tmp/requirements.txt && rm /tmp/requirements.txt
COPY README.md ./
COPY shared ./shared
COPY services ./services
COPY deploy ./deploy
RUN pip install --no-cache-dir --no-deps . && useradd --create-home rankscope
USER rankscope
ENV RANKSCOPE_DATA_DIR=/home/rankscope/.rankscope
EXPOSE 8000 8899
ENTRYPOINT ["rankscope"]
