# /etc/profile.d/aenv-ci.sh of code-interpreter-v1: Debian's /etc/profile sets PATH anew for
# every login shell (`bash -l`, which runs commands.run's commands), dropping the venv that the
# template's env put first; this puts it back, so `python` and `pip` are the venv's there too.
case ":$PATH:" in
*:/opt/aenv-ci/venv/bin:*) ;;
*) PATH="/opt/aenv-ci/venv/bin:$PATH" ;;
esac
export PATH
