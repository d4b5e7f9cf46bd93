# run5 ran run4/run.sh again (at 6887d85, after run4 at 9f2deb3 failed in its diagnostic mask):
bash ../run4/run.sh
