import pgcluster, shutil
orig = pgcluster.Cluster.destroy
def destroy(self):
    try: shutil.copy(self.log_file, f"/tmp/last-server-{self.major if hasattr(self,'major') else 'x'}.log")
    except Exception as e: print(e)
    orig(self)
pgcluster.Cluster.destroy = destroy
