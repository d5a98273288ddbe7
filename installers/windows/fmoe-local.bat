@echo off
rem fmoe-local launcher for Windows: double-click it (a console window opens and shows progress).
rem It only finds a Python >= 3.10 and hands over to installers\bootstrap.py, which holds all the logic.
rem Options: --repair (rebuild the environment), --smoke (headless self-test); anything else goes to app.py.
setlocal
set "BOOTSTRAP=%~dp0..\bootstrap.py"
set "PY="

rem The py launcher first, 3.11 preferred (the tested version); then whatever "python" is on PATH. The Microsoft
rem Store's "python" alias only prints a hint and fails the version check, so it is never picked.
for %%V in (3.11 3.12 3.13 3.10) do (
  if not defined PY (
    py -%%V -c "import sys" >nul 2>&1 && set "PY=py -%%V"
  )
)
if not defined PY (
  python -c "import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)" >nul 2>&1 && set "PY=python"
)
rem Any newer Python the py launcher knows (a 3.14-only machine, "Add to PATH" left unticked by the installer).
if not defined PY (
  py -3 -c "import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)" >nul 2>&1 && set "PY=py -3"
)
if not defined PY goto :nopython

%PY% "%BOOTSTRAP%" %*
set "STATUS=%ERRORLEVEL%"
if "%STATUS%"=="0" exit /b 0
if "%STATUS%"=="130" exit /b 130
goto :failed

:nopython
echo [fmoe-local] fmoe-local needs Python 3.10 or newer, and none was found.
echo [fmoe-local] Install Python 3.11 from https://www.python.org/downloads/windows/ (tick "Add python.exe to PATH"), then double-click fmoe-local.bat again.
set "STATUS=1"
goto :failed

:failed
rem Keep the window open so the message can be read, except in the headless self-test.
echo %* | findstr /c:"--smoke" >nul || pause
exit /b %STATUS%
