echo "loading data"
echo "no such file: data.npz" >&2
exit 3
