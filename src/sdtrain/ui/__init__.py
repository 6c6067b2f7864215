"""`sdtrain ui`: a local web app over the run folders under one root (runs, curves, samples, compare, start).

Optional (`pip install 'sdtrain[ui]'`): the app needs starlette and uvicorn, which nothing below this package
imports. `runs` and `jobs` are plain Python over run folders and child processes; `app` is the HTTP layer.
"""
