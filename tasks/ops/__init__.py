"""Operations: the local launcher and what it runs (embedded Redis, Flower, the Prometheus
exporter), status views and the systemd deployment."""
