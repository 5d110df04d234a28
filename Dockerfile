# One image for every rankscope service; compose.yaml picks the subcommand.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
COPY deploy ./deploy
RUN pip install --no-cache-dir . && useradd --create-home rankscope
USER rankscope
ENV RANKSCOPE_DATA_DIR=/home/rankscope/.rankscope
EXPOSE 8000 8899
ENTRYPOINT ["rankscope"]
