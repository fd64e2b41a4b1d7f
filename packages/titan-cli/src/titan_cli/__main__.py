from titan_cli.main import app

app()
