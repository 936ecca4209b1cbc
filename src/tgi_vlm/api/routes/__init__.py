"""FastAPI routers, one module per family: TGI's generate routes, OpenAI's, and service routes."""
