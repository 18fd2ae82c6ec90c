# Temper's CPU image: web, control and sandbox workers (requirements.txt; torch CPU build).
FROM python:3.11-slim-bookworm
RUN apt-get update && apt-get install -y --no-install-recommends bubblewrap curl && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY requirements.txt .
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
    && pip install --no-cache-dir -r requirements.txt
COPY . .
ENV DJANGO_SETTINGS_MODULE=webapp.settings PYTHONUNBUFFERED=1
RUN DEBUG=1 SECRET_KEY=build python manage.py collectstatic --noinput -v0
EXPOSE 8000
CMD ["python", "-m", "daphne", "-b", "0.0.0.0", "-p", "8000", "webapp.asgi:application"]
